"""The engine core's outputs: appending each sampled token to its sequence (stop checks,
detokenization, log-probs), the `StepOutput`s that carry it, and finishing, freeing and aborting
sequences and requests (ranked outputs for best_of).

A mixin of `EngineCore`: it works on the core's `groups`, `scheduler`, `sampler`, `_deferred`,
`max_model_len` and token counter, and its `_export_on_free`.
"""

from __future__ import annotations

import time
from typing import Any

from ksana_llm.engine.outputs import DeferredOutput, StepOutput
from ksana_llm.engine.request import FinishReason, Sequence, SequenceGroup


class OutputSteps:
    # ---- appending sampled tokens --------------------------------------------------------------
    def _append(self, seq: Sequence, index: int, token: int, logprob: float | None,
                rank: int | None, top: Any, now: float, defer: bool) -> list[StepOutput]:
        """`token` replaces the pending placeholder at `index` of the sequence's output; with
        log-probs, `rank` is its rank among them and `top` the top (id, log-prob) pairs."""
        seq.output_token_ids[index] = token
        seq.num_pending_tokens -= 1
        num_output = index + 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        entries = []
        if logprob is not None:
            seq.cumulative_logprob += logprob
            if seq.config.logprobs is not None:
                entry = {"token_id": token, "logprob": logprob, "rank": rank,
                         "top_logprobs": dict(top[:seq.config.logprobs]) if top else {}}
                seq.logprobs.append(entry)
                entries.append(entry)
        config = seq.config
        eos_stop = not config.ignore_eos and token in seq.eos_token_ids
        # vLLM's rule: a token that stops the sequence (EOS or stop_token_ids) stays in its token
        # ids but not in its text, unless include_stop_str_in_output.
        text_tokens = [token] if config.include_stop_str_in_output or not (
            eos_stop or token in config.stop_token_ids) else []
        # Without stop strings the text cannot end the sequence, so it can wait (see `step`).
        deferred = defer and not config.stop and not config.ranks_sequences
        update = None if deferred else seq.detokenizer.update(text_tokens)
        grammar_ended = refused = False
        if seq.matcher is not None:
            # A token the grammar refuses can only come from a row whose every token was masked;
            # either way the structured output cannot go on.
            refused = not seq.matcher.accept_token(token)
            grammar_ended = refused or seq.matcher.is_terminated()
        if update is not None and update.stop_str is not None:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, update.stop_str
        elif eos_stop:
            # The model's own end: no stop_reason, as in vLLM (a stop token or string has one).
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, None
        elif token in config.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
        elif grammar_ended:
            # Terminated: the grammar took its closing token, which only EOS can be, even under
            # ignore_eos: the model's own end, without a stop_reason as above. Refused: a dead end.
            seq.finish_reason = FinishReason.STOP
            seq.stop_reason = token if refused else None
        elif num_output >= config.max_new_tokens \
                or seq.num_prompt_tokens + num_output >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is not None and seq.num_pending_tokens:
            # A token sampled after the last one (async scheduling): dropped.
            del seq.output_token_ids[num_output:]
            seq.num_pending_tokens = 0
        if update is None:
            finishing = seq.finish_reason is not None
            self._deferred.append(DeferredOutput(seq, token, text_tokens, entries, finishing,
                                                  finishing and self._release(seq)))
            return []
        if config.ranks_sequences:
            seq.text += update.delta
            return self._finish_sequence(seq, [], "") if seq.finish_reason is not None else []
        if seq.finish_reason is not None:
            return self._finish_sequence(seq, [token], update.delta, entries)
        return [self._output(seq, [token], update.delta, entries)]

    def _output(self, seq: Sequence, tokens: list[int], delta: str,
                entries: list[dict[str, Any]], finished: bool = False) -> StepOutput:
        out = StepOutput(seq.request_id, tokens, delta, finished, seq.finish_reason,
                         seq.stop_reason, entries, first_scheduled_time=seq.first_scheduled_time,
                         index=seq.index, cumulative_logprob=self._cumulative(seq),
                         num_cached_tokens=seq.num_cached_tokens)
        self._attach_prompt_logprobs(seq.group, out)
        if finished:
            out.exported_kv = seq.group.exported_kv
        return out

    @staticmethod
    def _cumulative(seq: Sequence) -> float | None:
        c = seq.config
        tracked = c.logprobs is not None or c.num_sequences > c.num_return_sequences
        return seq.cumulative_logprob if tracked else None

    @staticmethod
    def _attach_prompt_logprobs(group: SequenceGroup, out: StepOutput) -> None:
        """The request's prompt log-probs ride on its first output after they are complete."""
        if group.prompt_logprobs is not None and not group.prompt_logprobs_sent:
            out.prompt_logprobs = group.prompt_logprobs
            group.prompt_logprobs_sent = True

    def _finish_sequence(self, seq: Sequence, tokens: list[int], delta: str,
                         entries: list[dict[str, Any]] | None = None) -> list[StepOutput]:
        """`seq` is done (its finish_reason is set): release it; outputs for what it adds, and the
        request's ranked outputs once its last sequence is done."""
        group = seq.group
        flushed = seq.detokenizer.flush() if seq.detokenizer is not None else ""
        last = self._release(seq)
        if group.config.ranks_sequences:
            seq.text += flushed
            return self._ranked_outputs(group) if last else []
        return [self._output(seq, tokens, delta + flushed, entries or [], finished=last)]

    def _free(self, seq: Sequence) -> None:
        """`seq` is done: release its blocks and queue place, and what the sampler keeps for it.
        A request that exports its KV (a single sequence) copies its prompt's KV out first."""
        self._export_on_free(seq)
        self.scheduler.finish(seq)
        if seq.sampling_row is not None:
            self.sampler.release(seq.sampling_row)
        # (speculative decoding's n-gram indexes, not needed any more)
        seq.ngram_index = seq.prediction_index = None

    def _release(self, seq: Sequence) -> bool:
        """Free the finished `seq`; whether it was its request's last live sequence."""
        group = seq.group
        self._free(seq)
        seq.finished_time = time.monotonic()
        group.seqs.remove(seq)
        group.finished.append(seq)
        last = not group.seqs
        if last:
            del self.groups[group.request_id]
        return last

    def _ranked_outputs(self, group: SequenceGroup) -> list[StepOutput]:
        """best_of: the num_return_sequences samples with the highest cumulative log-prob."""
        config = group.config
        ranked = sorted(group.finished, key=lambda s: -s.cumulative_logprob)
        best = ranked[:config.num_return_sequences]
        outputs = []
        for rank, seq in enumerate(best):
            out = StepOutput(group.request_id, list(seq.output_token_ids), seq.text,
                             rank == len(best) - 1, seq.finish_reason, seq.stop_reason,
                             list(seq.logprobs) if config.logprobs is not None else [],
                             first_scheduled_time=seq.first_scheduled_time, index=rank,
                             cumulative_logprob=seq.cumulative_logprob,
                             num_cached_tokens=seq.num_cached_tokens)
            self._attach_prompt_logprobs(group, out)
            outputs.append(out)
        return outputs

    def _abort_group(self, group: SequenceGroup, stop_reason: str | None,
                     error: Exception | None = None) -> list[StepOutput]:
        """Finish every live sequence of the request with finish_reason "abort" (and `error`:
        why it could not be served, which the request fails with)."""
        del self.groups[group.request_id]
        outputs = []
        live = list(group.seqs)
        for seq in live:
            seq.finish_reason, seq.stop_reason = FinishReason.ABORT, stop_reason
            self._free(seq)
            seq.finished_time = time.monotonic()
        group.seqs = []
        # Failed (`error`): one final output, which fails the request; per-sequence "abort"
        # finishes before it would read, to a stream, as samples stopped on purpose.
        if error is not None or group.config.ranks_sequences or not live:
            first = live[0] if live else None
            return [StepOutput(group.request_id, [], "", True, FinishReason.ABORT, stop_reason,
                               first_scheduled_time=first.first_scheduled_time if first else None,
                               error=error)]
        for k, seq in enumerate(live):
            flushed = seq.detokenizer.flush() if seq.detokenizer is not None else ""
            outputs.append(StepOutput(seq.request_id, [], flushed, k == len(live) - 1,
                                      FinishReason.ABORT, stop_reason,
                                      first_scheduled_time=seq.first_scheduled_time,
                                      index=seq.index, cumulative_logprob=self._cumulative(seq),
                                      error=error))
        return outputs
