"""The logits processors every row goes through before warping and sampling, in `transformers`'
order: logit bias, min_new_tokens stop suppression, repetition penalty, no-repeat n-grams, then
OpenAI presence/frequency penalties. Batched over rows with per-row parameter tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # only for annotations: the sampler imports this module
    from ksana_llm.runner.sampler import SamplingRow

__all__ = ["process_logits", "to_device"]


def to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, without waiting for the device.

    A blocking copy (`.to(device)`, `torch.tensor(..., device=...)`) synchronizes the stream, so
    the host would sit until the already queued forward is done. The source is pageable memory,
    which CUDA stages before the call returns, so it may be freed at once.
    """
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _index_tensor(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Right-pad token id lists into [R, L] int64, padding (and out-of-vocab ids) -> vocab_size.

    Scattering into a [R, vocab_size + 1] buffer then lets the padding land in a spare column
    that is dropped, like HF does for ids beyond the lm_head (which can never be generated).
    """
    width = max(1, max(len(t) for t in token_lists))
    padded = [t + [vocab_size] * (width - len(t)) for t in token_lists]
    return to_device(padded, torch.int64, device).clamp_(min=0, max=vocab_size)


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min_new_tokens suppression and penalties, for every row; returns a new float32 tensor.

    This is the part shared by greedy and sampled rows (HF applies its processors before the
    sampling warpers). The caller's tensor is never modified.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"expected logits [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
    vocab_size = logits.shape[1]
    device = logits.device
    # Our own copy: everything below may then work in place.
    out = logits.to(torch.float32, copy=True)

    # 0. Logit bias (first, as HF's SequenceBiasLogitsProcessor). Ids past the logits never win.
    bias = [(i, token, value) for i, row in enumerate(rows)
            for token, value in row.config.logit_bias.items() if token < vocab_size]
    if bias:
        rows_t = to_device([b[0] for b in bias], torch.int64, device)
        tokens_t = to_device([b[1] for b in bias], torch.int64, device)
        values = to_device([float(b[2]) for b in bias], torch.float32, device)
        out.index_put_((rows_t, tokens_t), values, accumulate=True)

    # 1. min_new_tokens: stop tokens are -inf until enough tokens have been produced. HF runs
    # this after the repetition penalty; the penalties keep -inf at -inf, so the order is moot.
    sup_rows: list[int] = []
    sup_tokens: list[int] = []
    for i, row in enumerate(rows):
        if row.suppresses_stop:
            for token in {*row.eos_token_ids, *row.config.stop_token_ids}:
                if 0 <= token < vocab_size:
                    sup_rows.append(i)
                    sup_tokens.append(token)
    if sup_rows:
        out[to_device(sup_rows, torch.int64, device), to_device(sup_tokens, torch.int64, device)] = (
            float("-inf"))

    # 2. Repetition penalty (HF): every token seen in prompt or output is scaled once,
    # multiplied when negative and divided when positive, so it always becomes less likely.
    rep = [i for i, row in enumerate(rows) if row.config.repetition_penalty != 1.0]
    if rep:
        index = _index_tensor(
            [rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep], vocab_size, device)
        seen = torch.zeros(len(rep), vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, index, True)
        seen = seen[:, :vocab_size]
        penalty = to_device([rows[i].config.repetition_penalty for i in rep], torch.float32,
                             device).unsqueeze(1)
        rep_idx = to_device(rep, torch.int64, device)
        sub = out.index_select(0, rep_idx)
        penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
        out.index_copy_(0, rep_idx, torch.where(seen, penalised, sub))

    # 2b. No repeated n-grams (HF, over prompt and output).
    for size in sorted({row.config.no_repeat_ngram_size for row in rows} - {0}):
        members = [i for i, row in enumerate(rows) if row.config.no_repeat_ngram_size == size]
        _ban_repeated_ngrams(out, [rows[i].prompt_token_ids + rows[i].output_token_ids
                                   for i in members], members, size)

    # 3. Presence / frequency penalties (OpenAI): output tokens only, additive, count-based.
    pf = [i for i, row in enumerate(rows)
          if row.config.presence_penalty != 0.0 or row.config.frequency_penalty != 0.0]
    if pf:
        index = _index_tensor([rows[i].output_token_ids for i in pf], vocab_size, device)
        counts = torch.zeros(len(pf), vocab_size + 1, dtype=torch.float32, device=device)
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
        counts = counts[:, :vocab_size]
        coeffs = to_device(
            [[rows[i].config.presence_penalty, rows[i].config.frequency_penalty] for i in pf],
            torch.float32, device)
        pf_idx = to_device(pf, torch.int64, device)
        delta = coeffs[:, 0:1] * (counts > 0).to(torch.float32) + coeffs[:, 1:2] * counts
        out.index_copy_(0, pf_idx, out.index_select(0, pf_idx) - delta)
    return out


def _ban_repeated_ngrams(out: torch.Tensor, token_lists: list[list[int]], members: list[int],
                         size: int) -> None:
    """-inf (in place, rows `members` of `out`) for every token that would complete an n-gram of
    `size` tokens already present, as HF's NoRepeatNGramLogitsProcessor: each window of the
    history whose first size-1 tokens equal the history's last size-1 tokens bans its last token.
    Batched over rows by right-padding the histories with -1."""
    lengths = [len(t) for t in token_lists]
    keep = [k for k, n in enumerate(lengths) if n >= size]  # no complete n-gram yet: no ban
    if not keep:
        return
    vocab_size, device = out.shape[1], out.device
    width = max(lengths[k] for k in keep)
    padded = [token_lists[k] + [-1] * (width - lengths[k]) for k in keep]
    tokens = to_device(padded, torch.int64, device)
    length = to_device([lengths[k] for k in keep], torch.int64, device)
    windows = tokens.unfold(1, size, 1)  # [R, W - size + 1, size]
    # The last size-1 tokens of each history.
    offsets = torch.arange(size - 1, device=device)
    prefix = tokens.gather(1, (length[:, None] - (size - 1) + offsets).clamp(min=0))
    matches = (windows[..., :-1] == prefix[:, None, :]).all(dim=-1)
    # Only windows lying inside the history (the one starting at the prefix is one token short).
    starts = torch.arange(windows.shape[1], device=device)
    matches &= starts[None, :] <= (length[:, None] - size)
    banned_ids = torch.where(matches, windows[..., -1].clamp(min=0, max=vocab_size), vocab_size)
    banned = torch.zeros(len(keep), vocab_size + 1, dtype=torch.bool, device=device)
    banned.scatter_(1, banned_ids, True)
    index = to_device([members[k] for k in keep], torch.int64, device)
    out.index_copy_(0, index, out.index_select(0, index).masked_fill(banned[:, :vocab_size],
                                                                     float("-inf")))
