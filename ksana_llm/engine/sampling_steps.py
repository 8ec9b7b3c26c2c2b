"""The engine core's sampling steps: sample a step's tokens on the device, and read them back.

With async scheduling (`EngineCore.step`) a step's tokens are read back after the next step is
launched; that step finds its pending input tokens on the device through `_pending_inputs`.

A mixin of `EngineCore`: it works on the core's `runner`, `scheduler`, `block_manager`,
`sampler`, `async_scheduling` and step in flight (`_in_flight`, `_captures_in_flight`), and its
`_detokenizer`, `_append`, `_read_captures`, `_drain_deferred` and `_abort_group`.
"""

from __future__ import annotations

import time

import torch

from ksana_llm.engine.outputs import SampledStep, StepOutput
from ksana_llm.engine.request import PENDING_TOKEN, Sequence, SequenceStatus
from ksana_llm.engine.scheduler_records import ScheduledSequence
from ksana_llm.runner.logits_processing import to_device
from ksana_llm.runner.model_runner import PendingInputs
from ksana_llm.runner.sampler import SamplingRow, seeded_draws


class SamplingSteps:
    def _pending_inputs(self, scheduled: list[ScheduledSequence]) -> PendingInputs | None:
        """Where the step's pending input tokens are: rows of the step in flight's samples."""
        in_flight = self._in_flight
        if in_flight is None:
            return None
        slices, source_rows = [], []
        for j, item in enumerate(scheduled):
            if item.seq.num_pending_tokens:
                if item.num_new_tokens != 1:  # pending tokens are only ever decoded
                    raise RuntimeError(f"a pending token scheduled in a {item.num_new_tokens}-"
                                       "token slice")
                slices.append(j)
                source_rows.append(in_flight.rows[item.seq])
        return PendingInputs(slices, source_rows, in_flight.token_ids) if slices else None

    @staticmethod
    def _sampling_row(seq: Sequence) -> SamplingRow:
        """The sequence's row, built once: it holds the sequence's own (growing) token lists,
        and a sequence whose grammar has terminated is finished, so it never changes."""
        if seq.sampling_row is None:
            seq.sampling_row = SamplingRow(
                config=seq.config, prompt_token_ids=seq.context_token_ids,
                output_token_ids=seq.output_token_ids, draws=seq.draws,
                eos_token_ids=seq.eos_token_ids, matcher=seq.matcher,
                need_logprob=seq.config.num_sequences > seq.config.num_return_sequences,
                engine_processors=seq.engine_processors, request_id=seq.request_id,
                index=seq.index)
        return seq.sampling_row

    def _launch_samples(self, seqs: list[Sequence], logits: torch.Tensor,
                        rows_of: list[int]) -> SampledStep:
        """Sample one token per sequence on the device, without waiting for it; each sequence
        gets a pending placeholder for it. A request's first sample forks it into all its
        samples, which draw from the same logits row."""
        row_seqs: list[Sequence] = []
        source: list[int] = []
        for seq, row in zip(seqs, rows_of):
            row_seqs.append(seq)
            source.append(row)
            if not seq.group.forked:
                for child in self._fork_samples(seq):
                    row_seqs.append(child)
                    source.append(row)
        if source != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(source, torch.long, logits.device))
        rows = [self._sampling_row(s) for s in row_seqs]
        sampled = self.sampler.sample(logits, rows)
        host = sampled.to_host()
        indices = []
        for seq in row_seqs:  # after sampling: penalties read the tokens before this one
            indices.append(len(seq.output_token_ids))
            seq.output_token_ids.append(PENDING_TOKEN)
            seq.num_pending_tokens += 1
        launched = SampledStep(row_seqs, indices, sampled.token_ids, host)
        if self.async_scheduling:
            launched.rows = dict(zip(row_seqs, range(len(row_seqs))))
        return launched

    def _fail_processor_errors(self, seqs: list[Sequence]) -> list[StepOutput]:
        """Requests whose own logits processor failed on this step's logits fail with its error
        (the token sampled for them is never read); the rest of the batch goes on."""
        failed = [seq for seq in seqs if seq.sampling_row is not None
                  and seq.sampling_row.processor_error is not None]
        if not failed:
            return []
        # As `abort` does: the deferred text and any step in flight come first, so no output
        # of a failed request is delivered after its end.
        outputs = self.settle()
        for seq in failed:
            if seq.status is not SequenceStatus.FINISHED:
                outputs.extend(self._abort_group(seq.group, None,
                                                 error=seq.sampling_row.processor_error))
        return outputs

    def settle(self) -> list[StepOutput]:
        """The deferred outputs, then the step in flight read back: afterwards nothing of the
        model runs until the next step (a weight update may change it)."""
        outputs = self._drain_deferred()
        outputs.extend(self._resolve_in_flight())
        return outputs

    def _resolve_in_flight(self) -> list[StepOutput]:
        """Read back the step in flight: its captured rows (prompt log-probs first: its tokens'
        outputs carry them), then its tokens."""
        captures, self._captures_in_flight = self._captures_in_flight, []
        outputs = self._read_captures(captures)
        step, self._in_flight = self._in_flight, None
        return outputs if step is None else outputs + self._resolve(step, defer=False)

    def _resolve(self, step: SampledStep, defer: bool) -> list[StepOutput]:
        """Read a step's tokens back and append them: stop checks, outputs (deferred to the
        next step when `defer` allows it)."""
        sampled = step.host.to_lists([seq.config.logprobs or 0 for seq in step.seqs]
                                     if step.host.top_k is not None else None)
        token_ids, logprobs, ranks, top = (sampled.token_ids, sampled.logprobs, sampled.ranks,
                                           sampled.top)
        now = time.monotonic()
        outputs = []
        block_size = self.block_manager.block_size
        # Only a step launched ahead computes a pending token's KV before it is known.
        publish = self.async_scheduling
        for i, seq in enumerate(step.seqs):
            if seq.status is SequenceStatus.FINISHED:
                continue  # stopped or aborted after this step was launched: a wasted row
            index = step.indices[i]
            outputs.extend(self._append(seq, index, token_ids[i],
                                        None if logprobs is None else logprobs[i],
                                        None if ranks is None else ranks[i],
                                        None if top is None else list(zip(top[1][i], top[0][i])),
                                        now, defer))
            # A token that completes a block the step in flight has computed: publish it.
            position = len(seq.prompt_token_ids) + index
            if publish and seq.num_computed_tokens > position and (position + 1) % block_size == 0 \
                    and seq.status is not SequenceStatus.FINISHED:
                self.block_manager.cache_full_blocks(seq)
        return outputs

    def _fork_samples(self, seq: Sequence) -> list[Sequence]:
        """The other num_sequences - 1 samples of `seq`'s request, sharing its blocks. Sample i of
        a seeded request draws from seed + i: it equals a single request with that seed."""
        group = seq.group
        group.forked = True
        seq.num_reserved_slots = 1
        children = []
        for i in range(1, group.config.num_sequences):
            child = seq.fork(i)
            child.prompt_logprobs = None  # computed once, by the first sequence
            child.num_reserved_slots = 1
            if group.config.seed is not None:
                child.draws = seeded_draws(group.config.seed + i, self.runner.device)
            child.detokenizer = self._detokenizer(child)
            self.scheduler.fork(seq, child)
            children.append(child)
        group.seqs.extend(children)
        group.next_index = group.config.num_sequences
        return children
