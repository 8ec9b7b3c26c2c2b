"""EngineCore.step(): schedule -> run -> sample -> update -> outputs. Single-threaded, no asyncio.

The core owns the scheduler, the block manager, the model runner and the sampler. Callers feed it
validated `Sequence`s and read back `StepOutput` deltas; the Python API and the server run it in
a background thread (see `ksana_llm.api`).

One request is one `SequenceGroup`. It starts as one sequence; when that sequence's prompt is
computed it either stays alone, or forks into `num_sequences` samples that share the prompt's KV
blocks (each with its own random stream: seed + i when the request is seeded), or runs beam search
(`beam_search.BeamSearch` picks the continuations; beams fork and are dropped, sharing blocks).
Outputs are per sequence (`StepOutput.index`, see `engine.outputs`); outputs that are ranked at
the end (beam search, best_of > n) are only emitted when the request finishes, best first.
Sampling and reading tokens back live in `engine.sampling_steps`, captured rows (forward-only
requests, prompt log-probs) in `engine.capture_steps`, beam search's steps in `engine.beam_steps`,
drafting and verifying drafts (speculative decoding) in `engine.speculative_steps`, KV exports
(prefill/decode disaggregation) in `engine.kv_export_steps`, appending tokens and finishing
sequences in `engine.output_steps`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ksana_llm.engine.beam_search import BeamSearch
from ksana_llm.engine.beam_steps import BeamSearchSteps
from ksana_llm.engine.capture_steps import CaptureSteps
from ksana_llm.engine.detokenizer import IncrementalDetokenizer
from ksana_llm.engine.kv_cache import BlockManager
from ksana_llm.engine.kv_export_steps import KvExportSteps
from ksana_llm.engine.ngram_proposer import NgramProposer
from ksana_llm.engine.output_steps import OutputSteps
from ksana_llm.engine.outputs import (
    CaptureRead,
    DeferredOutput,
    SampledStep,
    StepOutput,
    join_token_outputs,
)
from ksana_llm.engine.request import (
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from ksana_llm.engine.sampling_steps import SamplingSteps
from ksana_llm.engine.scheduler import Scheduler
from ksana_llm.engine.scheduler_records import (QueueTimeoutError, ScheduledSequence,
                                                SchedulerConfig, SchedulerOutput)
from ksana_llm.engine.speculative_steps import SpeculativeSteps
from ksana_llm.engine.step_histogram import HistogramSnapshot, StepHistogram
from ksana_llm.runner.model_runner import ModelRunner, SeqSlice, StepInput
from ksana_llm.runner.slices import PromptLogprobTargets
from ksana_llm.runner.sampler import Sampler, seeded_draws

# stop_reason of a request that expired in the waiting queue.
TIMEOUT_STOP_REASON = "timeout"


@dataclass(frozen=True)
class CoreStats:
    num_waiting: int
    num_running: int
    num_swapped: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    peak_used_blocks: int = 0
    num_draft_tokens: int = 0  # drafts verified so far (speculative decoding)
    num_accepted_draft_tokens: int = 0
    # Prefill/decode disaggregation: prompt tokens whose KV came from (went to) another engine.
    num_imported_kv_tokens: int = 0
    num_exported_kv_tokens: int = 0
    # LoRA: the adapters (ids) of running sequences, and of waiting or swapped-out ones.
    running_lora_ids: tuple[int, ...] = ()
    waiting_lora_ids: tuple[int, ...] = ()
    num_lora_loads: int = 0  # adapters copied into a device slot so far
    num_prompt_tokens: int = 0  # prompt tokens computed so far (cache hits and imports not)
    iteration_tokens: HistogramSnapshot | None = None  # tokens computed per step (drafts too)
    num_drafts: int = 0  # sequence-steps that verified drafts
    num_accepted_per_position: tuple[int, ...] = ()  # accepted drafts by position (0 = first)


def _lora_ids(*queues: list[Sequence]) -> tuple[int, ...]:
    return tuple(sorted({seq.lora_id for queue in queues for seq in list(queue) if seq.lora_id}))


class EngineCore(OutputSteps, SamplingSteps, CaptureSteps, BeamSearchSteps, SpeculativeSteps,
                 KvExportSteps):
    def __init__(self, runner: ModelRunner, block_manager: BlockManager,
                 scheduler_config: SchedulerConfig, tokenizer: Any, *, max_model_len: int,
                 sampler: Sampler | None = None, overlap_outputs: bool = False,
                 async_scheduling: bool = False, num_speculative_tokens: int = 0,
                 ngram: NgramProposer | None = None) -> None:
        if num_speculative_tokens and async_scheduling:
            raise ValueError("num_speculative_tokens does not work with async_scheduling (a "
                             "step's inputs depend on how many drafts the last one accepted)")
        self.runner = runner
        self.block_manager = block_manager
        self.scheduler = Scheduler(scheduler_config, block_manager)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.sampler = sampler or Sampler()
        self.groups: dict[str, SequenceGroup] = {}
        # Overlap output processing with the next step (see `step`). Exact for requests without
        # stop strings or ranking; those keep producing their outputs in their own step.
        self.overlap_outputs = overlap_outputs
        self._deferred: list[DeferredOutput] = []
        # Plan and launch the next step before this one's tokens are read back (see `step`).
        self.async_scheduling = async_scheduling
        self._in_flight: SampledStep | None = None
        self._captures_in_flight: list[CaptureRead] = []  # read before `_in_flight`'s tokens
        # Steps planned and their forward launched before the previous step's tokens were read
        # back (a structured-output step then still waits for them before it samples).
        self.num_steps_ahead = 0
        # Speculative decoding: drafts per sequence and step (0 = off), from the runner's draft
        # (MTP) layers or, with `ngram`, from the sequence itself; how many were verified /
        # accepted.
        self.num_speculative_tokens = num_speculative_tokens
        self.ngram = ngram
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        # Sequence-steps that verified drafts, and how often the draft at each position (0 =
        # the first) was accepted: vLLM's per-position counters, where acceptance falls off.
        self.num_drafts = 0
        self.num_accepted_per_position: list[int] = []
        self.num_prompt_tokens = 0  # prompt tokens computed so far (see _count_prompt_tokens)
        self.iteration_tokens = StepHistogram()
        self._init_exports()

    # ---- requests ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a validated sequence, the whole request for now (may raise QueueFullError).
        With `seq.export_kv`, its last output carries its prompt's KV (`StepOutput.exported_kv`,
        for another engine to decode from)."""
        if seq.request_id in self.groups:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        config = seq.config
        group = SequenceGroup(seq.request_id, config, seqs=[seq])
        several = seq.forward is None and config.num_sequences > 1
        group.forked = not several or config.use_beam_search
        if seq.prompt_logprobs is not None and seq.num_prompt_tokens == 1:
            group.prompt_logprobs = [None]  # nothing to score
        if several and config.use_beam_search:
            stop = [] if config.ignore_eos else list(seq.eos_token_ids)
            group.beam = BeamSearch(
                num_beams=config.num_beams, length_penalty=config.length_penalty,
                early_stopping=config.early_stopping, stop_token_ids=stop + config.stop_token_ids,
                max_generated=min(config.max_new_tokens, self.max_model_len - seq.num_tokens))
        seq.group = group
        seq.num_reserved_slots = config.num_sequences if several else 1
        seq.max_num_tokens = min(seq.num_prompt_tokens + config.max_new_tokens, self.max_model_len)
        # Everything that may fail comes before the scheduler takes the sequence, so a refused
        # request leaves nothing behind.
        if config.seed is not None and seq.draws is None:
            seq.draws = seeded_draws(config.seed, self.runner.device)
        seq.detokenizer = self._detokenizer(seq)
        self.scheduler.add(seq)
        self.groups[seq.request_id] = group

    def _detokenizer(self, seq: Sequence, *, stop_after_min_tokens: bool = True
                     ) -> IncrementalDetokenizer:
        """`stop_after_min_tokens`: stop strings wait for min_new_tokens (vLLM's rule); beam
        search's text does not, as its stop checks follow transformers (`StopStringCheck`)."""
        c = seq.config
        # Without a tokenizer the detokenizer makes no text (as for a weights-only model).
        return IncrementalDetokenizer(self.tokenizer if c.detokenize else None,
                                      seq.context_token_ids,
                                      skip_special_tokens=c.skip_special_tokens, stop=c.stop,
                                      include_stop_str_in_output=c.include_stop_str_in_output,
                                      min_tokens=c.min_new_tokens if stop_after_min_tokens else 0)

    def abort(self, request_id: str) -> list[StepOutput]:
        """Finish the request now (finish_reason "abort"), freeing every block it holds."""
        # The request's deferred text and tokens in flight come first (it may even have
        # finished already).
        outputs = self.settle()
        group = self.groups.get(request_id)
        return outputs if group is None else outputs + self._abort_group(group, None)

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self._deferred) or self._in_flight is not None
                or bool(self._captures_in_flight))

    def lora_ids_in_use(self) -> set[int]:
        """The LoRA adapters of every queued, running or swapped-out sequence."""
        s = self.scheduler
        return set(_lora_ids(s.waiting, s.running, s.swapped))

    def forget_lora(self, lora_id: int) -> None:
        """Adapter `lora_id` is unregistered (no sequence uses it): its slot is free again."""
        if self.scheduler.lora is not None:
            self.scheduler.lora.forget(lora_id)

    def stats(self) -> CoreStats:
        s, bm = self.scheduler, self.block_manager
        return CoreStats(len(s.waiting), len(s.running), len(s.swapped), bm.usage,
                         bm.num_free_blocks, bm.num_blocks, s.num_preemptions,
                         bm.prefix_queries, bm.prefix_hits, bm.peak_used_blocks,
                         self.num_draft_tokens, self.num_accepted_draft_tokens,
                         s.num_imported_kv_tokens, self.num_exported_kv_tokens,
                         _lora_ids(s.running), _lora_ids(s.waiting, s.swapped), s.num_lora_loads,
                         self.num_prompt_tokens, self.iteration_tokens.snapshot(),
                         self.num_drafts, tuple(self.num_accepted_per_position))

    # ---- one step ------------------------------------------------------------------------------
    def expire_waiting(self, timeout_s: float) -> list[StepOutput]:
        """Finish (finish_reason "abort", stop_reason "timeout") the requests that waited longer
        than `timeout_s` without ever being scheduled."""
        outputs = []
        for seq in self.scheduler.expire_waiting(time.monotonic() - timeout_s):
            error = QueueTimeoutError(
                f"request {seq.request_id} waited over {timeout_s * 1e3:g} ms "
                "(waiting_timeout_ms) without being scheduled")
            outputs.extend(self._abort_group(seq.group, TIMEOUT_STOP_REASON, error=error))
        return outputs

    def step(self, early: Callable[[list[StepOutput]], None] | None = None) -> list[StepOutput]:
        """Run one step; its outputs (with `overlap_outputs` or `async_scheduling`, mostly the
        previous step's).

        The host's per-step work is done while the device computes, where that keeps outputs
        exact:

        - `async_scheduling`: each step is planned and launched before the previous step's
          tokens are read back; its inputs come from the sampled tokens on the device, and the
          tokens are then read back, appended and checked (stops, lengths) while it runs. A
          sequence that stopped still ran in the step already launched: that row is dropped.
          A step sampling a grammar's row reads the previous step back between its forward's
          launch and its sampling (the grammar must see the token to mask the next); beam
          search's steps are read back at once.
        - `overlap_outputs`: a step read back at once defers detokenizing and building its
          `StepOutput`s to after the next step's launch.

        `early` (when given) receives the outputs made after the launch right then, so
        delivering them overlaps the device too. On a CPU nothing runs concurrently; both only
        delay outputs by a step there, which is why they are meant for CUDA.
        """
        plan = self.scheduler.schedule()
        unserved = self._drop_unloadable_adapters(plan)
        slices = [self._slice(item) for item in plan.scheduled]
        result = self.runner.execute(StepInput(slices, plan.swap_out, plan.swap_in,
                                               plan.copy_blocks,
                                               self._pending_inputs(plan.scheduled),
                                               plan.kv_imports, plan.lora_loads,
                                               plan.fresh_blocks))
        num_step_tokens = 0
        for item in plan.scheduled:
            num_step_tokens += item.num_new_tokens
            if item.seq.num_prompt_tokens_counted < len(item.seq.prompt_token_ids):
                self._count_prompt_tokens(item.seq, item.num_new_tokens)
            # Drafts count once verified (`_verify`).
            item.seq.num_computed_tokens += item.num_new_tokens - item.num_draft_tokens
            self.block_manager.cache_full_blocks(item.seq)
        if num_step_tokens:
            self.iteration_tokens.observe(num_step_tokens)
        sampled = [plan.scheduled[i].seq for i in result.sampled]
        logit_rows = self._logit_rows(slices, result.sampled)
        beams = [i for i, s in enumerate(sampled) if s.group.beam is not None]
        verifying = [i for i in range(len(sampled)) if slices[result.sampled[i]].num_draft_tokens]
        others = [i for i, s in enumerate(sampled)
                  if s.group.beam is None and not slices[result.sampled[i]].num_draft_tokens]
        outputs: list[StepOutput] = unserved
        if self._in_flight is not None and any(sampled[i].samples_from_host_tokens
                                               for i in others):
            # A grammar advances on the host with each token, and masks the next sample (a
            # request's own logits processors read the tokens too): read the step in flight
            # back first (this step's forward is queued meanwhile). A sequence that stopped
            # there is not sampled.
            outputs.extend(self._drain_deferred())
            outputs.extend(self._resolve_in_flight())
            others = [i for i in others if sampled[i].status is not SequenceStatus.FINISHED]
        launched = self._launch_samples([sampled[i] for i in others], result.logits,
                                        [logit_rows[i] for i in others]) if others else None
        if launched is not None:
            outputs.extend(self._fail_processor_errors(launched.seqs))
        captures = self._launch_captures(plan.scheduled, slices, result.captured)
        # This step is queued on the device: now the previous one's tokens and outputs.
        outputs.extend(self._drain_deferred())
        outputs.extend(self._resolve_in_flight())
        if early is not None and outputs:
            early(outputs)
            outputs = []
        if self.async_scheduling and not beams:
            self._captures_in_flight = captures
        else:
            # Beam search ends (and answers) in this step when it can: its prompt log-probs
            # must be there by then. Its step reads its results now anyway.
            outputs.extend(self._read_captures(captures))
        if self.async_scheduling:
            if launched is not None:
                self._in_flight = launched
                self.num_steps_ahead += 1
        elif launched is not None:
            outputs.extend(self._resolve(launched, defer=self.overlap_outputs))
        accepted: dict[Sequence, int] = {}
        if verifying:
            verified, accepted = self._verify(
                [sampled[i] for i in verifying], [slices[result.sampled[i]] for i in verifying],
                result.logits, [logit_rows[i] for i in verifying], defer=self.overlap_outputs)
            outputs.extend(verified)
        if beams:
            outputs.extend(self._collect_beams([sampled[i] for i in beams], result.logits,
                                               [logit_rows[i] for i in beams]))
        if self.num_speculative_tokens:
            self._propose(plan.scheduled, slices, accepted)
            self._finish_exports(outputs)
        if self._deferred and self._in_flight is None and not self.scheduler.has_work():
            outputs.extend(self._drain_deferred())  # no next step to overlap with
        return outputs

    def _drop_unloadable_adapters(self, plan: SchedulerOutput) -> list[StepOutput]:
        """Before the step runs: each LoRA adapter the plan copies into a slot must have its host
        copy (read again from its folder if max_cpu_loras dropped it). An adapter whose folder
        can no longer be read leaves the plan with its slot and its newly admitted requests;
        they and its waiting requests fail naming it, and the rest of the step runs."""
        failed: dict[int, ValueError] = {}
        for _, lora_id in plan.lora_loads:
            try:
                self.runner.prepare_lora(lora_id)
            except ValueError as exc:
                failed[lora_id] = ValueError(f"lora: {exc}")
        if not failed:
            return []
        plan.lora_loads = [load for load in plan.lora_loads if load[1] not in failed]
        self.scheduler.num_lora_loads -= len(failed)  # loads that did not happen
        for lora_id in failed:
            self.scheduler.lora.forget(lora_id)  # its slot is empty: another load may take it
        dropped = [item.seq for item in plan.scheduled if item.seq.lora_id in failed]
        plan.scheduled = [item for item in plan.scheduled if item.seq.lora_id not in failed]
        # Its waiting requests would fail the same way, each reading the folder again.
        dropped += [seq for seq in self.scheduler.waiting if seq.lora_id in failed]
        outputs: list[StepOutput] = []
        for seq in dropped:
            if seq.group.request_id in self.groups:  # (a request's sequences come once)
                outputs.extend(self._abort_group(seq.group, None, error=failed[seq.lora_id]))
        return outputs

    def _drain_deferred(self) -> list[StepOutput]:
        """The deferred outputs, in the order their tokens were sampled."""
        if not self._deferred:
            return []
        deferred, self._deferred = self._deferred, []
        outputs = []
        for item in deferred:
            seq = item.seq
            delta = seq.detokenizer.update(item.text_tokens).delta
            if item.finishing:
                delta += seq.detokenizer.flush()
            outputs.append(self._output(seq, [item.token], delta, item.entries, finished=item.last))
        # A speculative step's tokens: one delta (only those steps add several per sequence).
        return join_token_outputs(outputs) if self.num_speculative_tokens else outputs

    @staticmethod
    def _logit_rows(slices: list[SeqSlice], sampled: list[int]) -> list[int]:
        """The first logits row of each sampled slice (a slice with drafts has 1 + k rows)."""
        rows, row = [], 0
        for i in sampled:
            rows.append(row)
            row += 1 + slices[i].num_draft_tokens
        return rows

    def _count_prompt_tokens(self, seq: Sequence, num_new: int) -> None:
        """The prompt tokens this step computes for the first time (cache hits and imported KV
        are never computed; a recompute was counted already)."""
        start = max(seq.num_computed_tokens, seq.num_prompt_tokens_counted)
        reached = min(seq.num_computed_tokens + num_new, len(seq.prompt_token_ids))
        if reached > start:
            self.num_prompt_tokens += reached - start
        seq.num_prompt_tokens_counted = max(seq.num_prompt_tokens_counted, reached)

    def _slice(self, item: ScheduledSequence) -> SeqSlice:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens - item.num_draft_tokens
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        tokens = seq.tokens_slice(start, end)
        # Embeddings only replace prompt rows; decode slices need not carry them.
        embeddings = seq.embeddings if start < seq.num_prompt_tokens else None
        spec = seq.forward
        if spec is not None:
            lo, hi = bisect.bisect_left(spec.positions, start), bisect.bisect_left(spec.positions, end)
            return SeqSlice(tokens, start, seq.block_table, sample=False,
                            capture=spec.positions[lo:hi], capture_logits=spec.logits,
                            embeddings=embeddings, lora_slot=seq.lora_slot,
                            long_rope=seq.long_rope)
        capture: tuple[int, ...] = ()
        if seq.prompt_logprobs is not None:
            # Row p scores prompt token p + 1; rows already collected (before a recompute) are not
            # captured again.
            capture = tuple(p for p in range(start, min(end, seq.num_prompt_tokens - 1))
                            if p + 1 not in seq.prompt_logprobs)
        if item.num_draft_tokens:
            tokens = tokens + seq.draft_token_ids[:item.num_draft_tokens]
        scored = PromptLogprobTargets(tuple(seq.prompt_token_ids[p + 1] for p in capture),
                                      seq.config.prompt_logprobs or 0) if capture else None
        return SeqSlice(tokens, start, seq.block_table, sample=end == seq.num_tokens,
                        capture=capture, prompt_logprobs=scored, embeddings=embeddings,
                        num_draft_tokens=item.num_draft_tokens, lora_slot=seq.lora_slot,
                        long_rope=seq.long_rope)
