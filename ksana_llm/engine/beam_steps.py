"""The engine core's beam-search steps: collect each beam's log-probs, advance a request's beams
together (`beam_search.BeamSearch` picks the continuations; beams fork and are dropped, sharing
blocks) and emit the best hypotheses when it is done.

A mixin of `EngineCore`: it works on the core's `scheduler`, `groups`, `tokenizer`,
and its `_sampling_row`, `_free`, `_detokenizer`, `_attach_prompt_logprobs` and
`_fail_processor_errors`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ksana_llm.engine.beam_search import Hypothesis, length_normalized
from ksana_llm.engine.outputs import StepOutput
from ksana_llm.engine.request import FinishReason, Sequence, SequenceGroup, SequenceStatus
from ksana_llm.runner.logits_processing import to_device
from ksana_llm.runner.logprobs_mode import chosen_ranks, reported_values
from ksana_llm.runner.sampler import beam_log_probs


class StopStringCheck:
    """Which stop string, if any, a continuation (parent beam, token) ends on: one that overlaps
    the token's text, as transformers' `StopStringCriteria` (a stop string wholly before the
    token would have ended the parent already). The text is the raw decode (special tokens
    kept) of the parent's last tokens, prompt included, and the token."""

    def __init__(self, tokenizer: Any, stop: list[str], seqs: list[Sequence]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.seqs = seqs
        # Enough tokens to hold the longest stop string, even through tokens that decode to
        # nothing on their own (pieces of a multi-byte character).
        self.tail = 2 * max(len(s) for s in stop) + 8
        self._texts: dict[int, tuple[list[int], str]] = {}  # parent -> (tail ids, their text)

    def __call__(self, parent: int, token: int) -> str | None:
        if parent not in self._texts:
            seq = self.seqs[parent]
            ids = (seq.context_token_ids + seq.output_token_ids)[-self.tail:]
            self._texts[parent] = (ids, self.tokenizer.decode(ids))
        ids, before = self._texts[parent]
        text = self.tokenizer.decode(ids + [token])
        for stop in self.stop:
            # An occurrence overlapping the new token's text ends after `before`.
            if text.find(stop, max(0, len(before) - len(stop) + 1)) >= 0:
                return stop
        return None


class BeamSearchSteps:
    def _collect_beams(self, seqs: list[Sequence], logits: torch.Tensor,
                       rows_of: list[int]) -> list[StepOutput]:
        """Keep each beam's log-probs; a request whose live beams all have theirs takes a step.
        (Beams of one request normally decode in the same step; one that was preempted or ran
        out of budget catches up, and its siblings wait idle meanwhile.)"""
        sub = logits.index_select(0, to_device(rows_of, torch.long, logits.device))
        processed, raw = beam_log_probs(sub, [self._sampling_row(s) for s in seqs],
                                     self.sampler.logits_processors)
        mode = self.sampler.logprobs_mode
        # What the beams' log-probs report: beams rank the processed log-probs themselves.
        reported = raw if mode == "raw_logprobs" else reported_values(mode, sub, processed)
        outputs: list[StepOutput] = self._fail_processor_errors(seqs)
        ready: list[SequenceGroup] = []
        for k, seq in enumerate(seqs):
            group = seq.group
            if seq.status is SequenceStatus.FINISHED:
                continue  # its request failed above
            seq.num_reserved_slots = 1  # the group's width is reserved by its live beams now
            group.beam.rows[seq] = (processed[k], reported[k])
            if group not in ready and all(s in group.beam.rows for s in group.seqs):
                ready.append(group)
        for group in ready:
            outputs.extend(self._beam_step(group))
        return outputs

    def _beam_step(self, group: SequenceGroup) -> list[StepOutput]:
        beam, config, seqs = group.beam, group.config, list(group.seqs)
        processed = torch.stack([beam.rows[s][0] for s in seqs])
        reported = torch.stack([beam.rows[s][1] for s in seqs])
        beam.rows = {}
        want = config.logprobs
        stop = set(beam.stop_token_ids.tolist())

        def entry(parent: int, token: int) -> dict[str, Any]:
            row = reported[parent]
            top = torch.topk(row, want) if want else None
            return {"token_id": token, "logprob": float(row[token]),
                    "rank": int(chosen_ranks(row.unsqueeze(0), row[token].unsqueeze(0))),
                    "top_logprobs": dict(zip(top.indices.tolist(), top.values.tolist())) if top else {}}

        def finalize(parent: int, token: int, score: float, sum_logprob: float,
                     stop_string: str | None) -> Hypothesis:
            p = seqs[parent]
            return Hypothesis(p.output_token_ids + [token], score, sum_logprob,
                              "stop" if token in stop or stop_string is not None else "length",
                              p.logprobs + [entry(parent, token)] if want is not None else None,
                              stop_string)

        stop_string = StopStringCheck(self.tokenizer, config.stop, seqs) if config.stop else None
        continuations = beam.step(processed, finalize, stop_string)
        if beam.done:
            num = config.num_return_sequences
            # Finished hypotheses may have scored below transformers' -1e9 filler (a strongly
            # negative length_penalty, or rows whose every token was masked), leaving fewer
            # than asked for: the beams still running make up the rest, after them (a request
            # always gets its num_return_sequences answers; transformers would pad).
            best = beam.results(num)
            missing = num - len(best)
            sums = beam.kept_sum_logprobs[:missing].double()
            scores = length_normalized(sums, beam.num_generated, beam.length_penalty)
            best += [finalize(parent, token, score, sum_logprob,
                              stop_string(parent, token) if stop_string else None)
                     for (parent, token), score, sum_logprob in zip(
                         continuations[:missing], scores.tolist(), sums.tolist())]
            return self._finish_beams(group, best)
        # Parents chosen once continue themselves; chosen again, they fork first (before any
        # token is appended); parents nobody chose are dropped.
        plan: list[tuple[Sequence, int, int]] = []
        reused: set[int] = set()
        for parent, token in continuations:
            if parent in reused:
                child = seqs[parent].fork(group.next_index)
                group.next_index += 1
                self.scheduler.fork(seqs[parent], child)
                plan.append((child, parent, token))
            else:
                reused.add(parent)
                plan.append((seqs[parent], parent, token))
        for i, seq in enumerate(seqs):
            if i not in reused:
                self._free(seq)
        now = time.monotonic()
        for seq, parent, token in plan:
            seq.output_token_ids.append(token)
            if want is not None:
                seq.logprobs.append(entry(parent, token))
            if seq.first_token_time is None:
                seq.first_token_time = now
        group.seqs = [seq for seq, _, _ in plan]
        return []

    def _finish_beams(self, group: SequenceGroup, best: list[Hypothesis]) -> list[StepOutput]:
        """Free the beams and emit `best`, the request's answers, best first."""
        for seq in group.seqs:
            self._free(seq)
        first = group.seqs[0]
        group.seqs = []
        del self.groups[group.request_id]
        outputs = []
        config = first.config
        for rank, hyp in enumerate(best):
            reason = FinishReason.STOP if hyp.finish_reason == "stop" else FinishReason.LENGTH
            stop_reason = None  # an EOS ending, or a length one
            text_tokens = list(hyp.token_ids)
            if reason is FinishReason.STOP and hyp.stop_string is None:
                last = hyp.token_ids[-1]
                stop_reason = last if last in config.stop_token_ids else None
                # As for sampled sequences: the stop token is not in the text.
                if not config.include_stop_str_in_output:
                    text_tokens.pop()
            elif reason is FinishReason.STOP:
                stop_reason = hyp.stop_string
            detok = self._detokenizer(first, stop_after_min_tokens=False)
            text = detok.update(text_tokens).delta + detok.flush()
            out = StepOutput(group.request_id, list(hyp.token_ids), text, rank == len(best) - 1,
                             reason, stop_reason,
                             list(hyp.logprobs or []), first_scheduled_time=first.first_scheduled_time,
                             index=rank, cumulative_logprob=hyp.sum_logprob, score=hyp.score,
                             num_cached_tokens=first.num_cached_tokens)
            self._attach_prompt_logprobs(group, out)
            outputs.append(out)
        return outputs
