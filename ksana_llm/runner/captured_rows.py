"""A step's captured rows (`SeqSlice.capture`): forward-only requests' final hidden states and
logits, and prompt log-probs.

The rows that need logits go through the LM head a slice of rows at a time, and each slice is
reduced before the next is made: forward-only logits are copied to the host, prompt log-probs'
rows become their log-probs (`runner.prompt_logprobs.token_logprobs`). So a whole prompt chunk's
logits never exist on the device at once ([8192, vocab] float32 is 5 GB at Qwen's 151,936
tokens, room the KV sizing does not leave); one slice's work is in the profiled step
(`runner.memory.profile_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ksana_llm.runner.host_copy import HostCopy, copies_done, host_buffer
from ksana_llm.runner.logits_processing import to_device
from ksana_llm.runner.prompt_logprobs import TOKEN_LOGPROBS_CHUNK_ELEMENTS, token_logprobs
from ksana_llm.runner.slices import SeqSlice

__all__ = ["CAPTURE_CHUNK_ELEMENTS", "CapturedRows", "capture_rows", "logit_rows_per_chunk"]

# Float32 logits made at once for captured rows (512 MiB): the prompt log-probs' own slice, so
# each LM-head slice is reduced in one piece.
CAPTURE_CHUNK_ELEMENTS = TOKEN_LOGPROBS_CHUNK_ELEMENTS


@dataclass(frozen=True)
class CapturedRows:
    """What one slice asked for, its rows in the order of its `capture` positions."""

    hidden: torch.Tensor  # [len(capture), hidden] (after the final norm), on the device
    # [len(capture), vocab] float32 on its way to the host, when `capture_logits`
    logits: HostCopy | None = None
    # [len(capture), 2 + 2K] float64 on its way to the host, with `prompt_logprobs`: each row's
    # chosen log-prob, its rank, then the top K values and the top K ids (ids < 2**53: exact),
    # K the largest top_k of the step's slices (a slice reads its own top_k first of them).
    prompt_logprobs: HostCopy | None = None


def logit_rows_per_chunk(vocab_size: int, chunk_elements: int = CAPTURE_CHUNK_ELEMENTS) -> int:
    return max(1, chunk_elements // max(1, vocab_size))


def capture_rows(model: nn.Module, slices: list[SeqSlice], rows_of: dict[int, list[int]],
                 hidden: torch.Tensor, *, chunk_elements: int = CAPTURE_CHUNK_ELEMENTS,
                 to_host: bool = True) -> dict[int, CapturedRows]:
    """Slice index -> its captured rows, for every slice in `rows_of` (slice index -> its rows
    of `hidden`). Logits and log-probs are None on pipeline stages without the LM head, and
    with `to_host` False: a tensor-parallel worker rank, whose results nobody reads, still
    runs the LM head slice by slice (its collective must match rank 0's calls) but copies
    and reduces nothing."""

    # 0: forward logits, 1: prompt log-probs, 2: hidden rows only
    kind = {i: 0 if slices[i].capture_logits else 1 if slices[i].prompt_logprobs else 2
            for i in rows_of}
    if any(kind[i] == 1 and len(slices[i].prompt_logprobs.token_ids) != len(rows_of[i])
           for i in rows_of):
        raise ValueError("prompt_logprobs: one target token per captured row")
    # One LM-head pass for all the step's logit rows: they are one block at the top of `picked`.
    order = sorted(rows_of, key=lambda i: (kind[i], i))
    picked = hidden.index_select(0, to_device([r for i in order for r in rows_of[i]], torch.long,
                                              hidden.device))
    num_logit_rows = sum(len(rows_of[i]) for i in order if kind[i] == 0)
    scored = [slices[i].prompt_logprobs for i in order if kind[i] == 1]
    targets = [t for s in scored for t in s.token_ids]
    logits, logprobs = _reduce_logits(model, picked[:num_logit_rows + len(targets)],
                                      num_logit_rows, targets,
                                      max((s.top_k for s in scored), default=0), chunk_elements,
                                      to_host)
    out: dict[int, CapturedRows] = {}
    offset = 0
    for i in order:
        lo, hi = offset, offset + len(rows_of[i])
        rows_logits = rows_logprobs = None
        if kind[i] == 0 and logits is not None:
            rows_logits = HostCopy(logits.tensor[lo:hi], logits.copied)
        elif kind[i] == 1 and logprobs is not None:  # its rows come after the logit rows
            rows_logprobs = HostCopy(logprobs.tensor[lo - num_logit_rows:hi - num_logit_rows],
                                     logprobs.copied)
        out[i] = CapturedRows(picked[lo:hi], rows_logits, rows_logprobs)
        offset = hi
    return out


def _reduce_logits(model: nn.Module, rows: torch.Tensor, num_logit_rows: int,
                   targets: list[int], top_k: int, chunk_elements: int, to_host: bool
                   ) -> tuple[HostCopy | None, HostCopy | None]:
    """Logits of `rows` a slice at a time: the first `num_logit_rows` rows' copied to the host
    whole, the others' reduced to the prompt log-probs of `targets` (one per row) with `top_k`
    alternatives. (None, None) on a pipeline stage without the LM head, and (the LM head
    run all the same) without `to_host`."""
    step = logit_rows_per_chunk(model.config.vocab_size, chunk_elements)
    if not to_host:
        for lo in range(0, rows.shape[0], step):
            model.compute_logits(rows[lo:lo + step])
        return None, None
    targets_t = to_device(targets, torch.long, rows.device) if targets else None
    host: torch.Tensor | None = None  # the forward logits, filled slice by slice
    scored: torch.Tensor | None = None  # the packed prompt log-probs, filled slice by slice
    for lo in range(0, rows.shape[0], step):
        chunk = model.compute_logits(rows[lo:lo + step])
        if chunk is None:
            return None, None
        split = min(max(num_logit_rows - lo, 0), chunk.shape[0])  # chunk rows that are logits
        if split:
            if host is None:
                host = host_buffer((num_logit_rows, chunk.shape[1]), chunk)
            # Queued on the stream; the chunk's memory is reused by the next slice only after.
            host[lo:lo + split].copy_(chunk[:split], non_blocking=True)
        if split < chunk.shape[0]:
            first = lo + split - num_logit_rows
            chosen, ranks, values, ids = token_logprobs(
                chunk[split:], targets_t[first:first + chunk.shape[0] - split], top_k,
                chunk_elements=chunk_elements)
            packed = torch.cat((chosen.double().unsqueeze(1), ranks.double().unsqueeze(1),
                                values.double(), ids.double()), dim=1)
            if scored is None:
                scored = host_buffer((len(targets), packed.shape[1]), packed)
            # To the host slice by slice, as the logits: with many alternatives (-1: the whole
            # vocabulary) a prompt chunk's packed rows would not fit on the device at once.
            scored[first:first + packed.shape[0]].copy_(packed, non_blocking=True)
    logits = copies_done(host, rows.device) if host is not None else None
    logprobs = copies_done(scored, rows.device) if scored is not None else None
    return logits, logprobs
