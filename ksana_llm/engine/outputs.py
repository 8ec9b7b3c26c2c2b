"""What an engine step gives back: per-sequence `StepOutput` deltas (and the records behind them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ksana_llm.engine.request import FinishReason, Sequence
from ksana_llm.runner.host_copy import HostCopy
from ksana_llm.runner.sampled_tokens import HostSamples


@dataclass(frozen=True)
class ForwardResult:
    """A forward-only request's captured rows, on the CPU, in `ForwardSpec.positions` order."""

    positions: list[int]
    hidden: Any  # torch.Tensor [P, hidden] float32 (after the final norm), or None
    logits: Any  # torch.Tensor [P, vocab] float32, or None


@dataclass(slots=True)
class StepOutput:
    """What one step added to one sequence of one request.

    `index`: the sequence (0 for single-sequence requests; for ranked outputs, the rank).
    `finish_reason` is set on the last output of that sequence; `finished` on the last output of
    the whole request (all its sequences are done).
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    new_logprobs: list[dict[str, Any]] = field(default_factory=list)
    forward: ForwardResult | None = None  # set on the (only) output of a forward-only request
    first_scheduled_time: float | None = None  # time.monotonic() when it first got compute
    index: int = 0
    cumulative_logprob: float | None = None  # the sequence's, when log-probs are computed
    score: float | None = None  # beam search: the hypothesis' length-penalised score
    # Set once per request, on the first output after its prompt is computed (when asked).
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    # Set on the last output of a request that exports its KV (a runner.kv_transfer.TransferredKv).
    exported_kv: Any = None
    # Prompt tokens whose KV came from the prefix cache or a KV transfer (set once its prompt
    # was scheduled).
    num_cached_tokens: int | None = None
    # Set on the outputs of a request the engine could not serve (finish_reason "abort"): why,
    # as the exception the request fails with (a QueueTimeoutError for a queue timeout, a
    # ValueError for an adapter that cannot be read); the engine goes on with the others.
    error: Exception | None = None


def join_token_outputs(outputs: list[StepOutput]) -> list[StepOutput]:
    """One output per sequence per step: adjacent outputs of the same sequence (the several
    tokens a speculative step accepts) joined into one delta, as vLLM streams them. Only an
    output whose sequence goes on is joined with the next; the joined output keeps the
    earlier's once-per-request fields and takes the later's end-of-sequence ones."""
    joined: list[StepOutput] = []
    for out in outputs:
        prev = joined[-1] if joined else None
        if prev is None or prev.request_id != out.request_id or prev.index != out.index \
                or prev.finish_reason is not None or prev.forward is not None \
                or out.forward is not None or prev.score is not None:
            joined.append(out)
            continue
        prev.new_token_ids = prev.new_token_ids + out.new_token_ids
        prev.text_delta += out.text_delta
        prev.new_logprobs = prev.new_logprobs + out.new_logprobs
        prev.finished, prev.finish_reason, prev.stop_reason = \
            out.finished, out.finish_reason, out.stop_reason
        prev.cumulative_logprob = out.cumulative_logprob
        prev.score = out.score
        if prev.prompt_logprobs is None:
            prev.prompt_logprobs = out.prompt_logprobs
        prev.exported_kv = out.exported_kv if out.exported_kv is not None else prev.exported_kv
        if out.num_cached_tokens is not None:
            prev.num_cached_tokens = out.num_cached_tokens
        prev.error = out.error
    return joined


@dataclass(slots=True)
class DeferredOutput:
    """A sampled token whose text and `StepOutput` are made while the device runs the next step.

    Everything that decides what runs next (appending the token, stop checks, freeing a finished
    sequence) has happened; only the detokenization and the output itself wait.
    """

    seq: Sequence
    token: int
    text_tokens: list[int]  # what goes to the detokenizer: [token], or [] for a stop token
    entries: list[dict[str, Any]]
    finishing: bool  # the sequence ended with this token: flush its held-back text
    last: bool  # ... and it was its request's last live sequence


@dataclass(slots=True)
class SampledStep:
    """One step's sampled tokens: chosen on the device, on their way back to the host.

    Each sequence already holds a pending placeholder at `indices[i]` of its output tokens (so
    the scheduler counts the token); `EngineCore._resolve` writes the real ids in. With async
    scheduling that happens after the next step is launched, which reads its inputs straight
    from `token_ids` on the device (`rows` maps a sequence to its row there).
    """

    seqs: list[Sequence]
    indices: list[int]
    token_ids: torch.Tensor  # [len(seqs)] int64, on the device
    host: HostSamples
    rows: dict[Sequence, int] = field(default_factory=dict)


@dataclass(slots=True)
class CaptureRead:
    """One sequence's captured rows of a step, on their way to the host (`EngineCore.
    _launch_captures`): its prompt log-probs, or a forward-only request's hidden states and
    logits at `positions`. With async scheduling they are read with the step's tokens, after the
    next step is launched."""

    seq: Sequence
    positions: tuple[int, ...]
    # [n, 2 + 2K] float64: chosen, rank, top K values, top K ids (runner.captured_rows)
    prompt_logprobs: HostCopy | None = None
    hidden: HostCopy | None = None  # [n, hidden] float32
    logits: HostCopy | None = None  # [n, vocab] float32
    done: bool = False  # a forward-only sequence whose prompt is all computed: it is answered
