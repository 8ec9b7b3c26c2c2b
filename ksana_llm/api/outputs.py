"""Public result records: what a request produced (`RequestOutput`, one `SequenceOutput` per
sequence, a `SequenceDelta` per step) and its timings. The request records are in api/request.py;
the handle that delivers these to the caller is in api/request_handle.py."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


from ksana_llm.runner.kv_transfer import TransferredKv
# Re-exported: callers import the request records from here too.
from ksana_llm.api.request import Prompt, Request, as_token_ids  # noqa: F401

@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None  # when the engine first gave it compute
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Seconds spent waiting before the engine first scheduled it."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class SequenceOutput:
    """One returned sequence of a request (a sample, or a beam).

    `cumulative_logprob`: the sum of its tokens' log-probs (for samples: what the engine's
    `logprobs_mode` reports, by default the raw model distribution's; for beams, the processed log-probs beam search ranks by), when computed (logprobs asked,
    best_of, beam search). `score`: beam search's length-penalised score (transformers'
    `sequences_scores`). `logprobs`: per-token entries as in `RequestOutput.logprobs`.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None
    stop_reason: str | int | None = None
    score: float | None = None


@dataclass(frozen=True)
class SequenceDelta:
    """What one engine step added to one sequence of a request, as streamed by
    `RequestHandle.deltas()` / `adeltas()`.

    `index` is the sequence's place in `RequestOutput.sequences` (the OpenAI choice index).
    Parallel samples (n > 1 without best_of) stream as they go, interleaved; beam search and
    best_of > n rank their sequences at the end, so each of those arrives as one delta holding
    its whole text, best first. A sequence's last delta has `finish_reason` set (its text may be
    empty); the iteration ends once every sequence has finished.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None = None  # entries added by this step, when asked
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """A request's result so far (final once `finished`).

    The top-level `text`, `token_ids`, `logprobs`, `finish_reason` and `stop_reason` are those of
    sequence 0 (the best one for beam search and best_of); `sequences` lists every returned
    sequence. `logprobs` (when asked): one entry per generated token, `{"token_id", "logprob",
    "rank", "top_logprobs": {id: logprob}}`, `rank` counting from 1 (a tie counts against the
    token, as in vLLM). `prompt_logprobs` (when asked): one entry per prompt token, the first
    None, each like the `logprobs` entries. `extra`: free-form fields a plugin's postprocess
    added.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    # the stop string or stop token (stop_token_ids) that ended it; None at EOS, as in vLLM
    stop_reason: str | int | None = None
    logprobs: list[dict[str, Any]] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Set for requests returning several sequences; `sequences` derives one from the top-level
    # fields otherwise.
    sequence_outputs: list[SequenceOutput] = field(default_factory=list)
    cumulative_logprob: float | None = None  # sequence 0's
    score: float | None = None  # sequence 0's beam score
    # The prompt's KV, for a request submitted with `export_kv=True` (a TransferredKv; hand it
    # to another engine as `Request(imported_kv=...)`).
    exported_kv: TransferredKv | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache or a transfer
    # Why a failed request ended (queue timeout, shutdown, ...): set only on the last output a
    # callback gets for it (finished, finish_reason "abort"); None for one that ended normally.
    error: str | None = None

    @property
    def sequences(self) -> list[SequenceOutput]:
        if self.sequence_outputs:
            return self.sequence_outputs
        cumulative = self.cumulative_logprob
        if cumulative is None and self.logprobs:
            cumulative = sum(entry["logprob"] for entry in self.logprobs)
        return [SequenceOutput(self.text, list(self.token_ids), cumulative, self.finish_reason,
                               self.logprobs, self.stop_reason, self.score)]


class RequestError(RuntimeError):
    """The engine could not finish this request (it died or shut down)."""
