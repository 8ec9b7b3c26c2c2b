"""Token bitmasks: one int32 word per 32 vocabulary ids, bit set = token allowed."""

from __future__ import annotations

import torch
import xgrammar as xgr


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask of `[batch, ceil(vocab_size / 32)]`, every token allowed."""
    if batch < 1 or vocab_size < 1:
        raise ValueError(f"allocate_bitmask needs batch >= 1 and vocab_size >= 1, "
                         f"got {batch} and {vocab_size}")
    return xgr.allocate_token_bitmask(batch, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  indices: list[int] | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    `logits` is `[B, V]`; `bitmask` row i masks logits row i. `indices` restricts the masking to
    those rows (the others are unconstrained requests in the same batch). Logits columns beyond
    the bitmask's width are left alone; the bitmask must be allocated with the logits width.
    """
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError("apply_bitmask takes 2-D logits [B, V] and a 2-D bitmask")
    if indices is not None and not indices:
        return
    if bitmask.device != logits.device:
        # The matchers fill the mask on the host; the copy overlaps with nothing on CPU and is
        # a small H2D transfer on CUDA.
        bitmask = bitmask.to(logits.device, non_blocking=True)
    vocab_size = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if logits.device.type == "cpu" and logits.dtype not in (torch.float32, torch.float16,
                                                            torch.bfloat16):
        backend = "torch_native"
    else:
        backend = "auto"
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=indices,
                                    backend=backend)


def _bit(token_id: int) -> tuple[int, int]:
    """(word, value) of `token_id`'s bit, the value as the signed int32 the word holds."""
    value = 1 << (token_id % 32)
    return token_id // 32, value - (1 << 32) if value >= 1 << 31 else value


def allow_only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Row `row` allows `token_id` alone."""
    word, value = _bit(token_id)
    bitmask[row].zero_()
    bitmask[row, word] = value


def allow_also(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Row `row` allows `token_id` besides what it allowed."""
    word, value = _bit(token_id)
    bitmask[row, word] = int(bitmask[row, word]) | value
