"""Paged KV batches at Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head dim 128,
blocks of 16) for the GPU kernel benchmarks, and the torch backend's way of attending over them
(gather the paged K/V, then SDPA) as their peer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16  # Qwen3-0.6B attention


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, W] int32, blocks scattered at random
    lens: torch.Tensor  # [B] int32


def make_paged(lens: list[int], dtype: torch.dtype, seed: int = 0,
               width: int | None = None) -> Paged:
    """`width`: block-table columns (default: the longest sequence's blocks), e.g. a CUDA
    graph's, which the split count is chosen from."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    width = max(max(per_seq), width or 0)
    num_blocks = sum(per_seq)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen, device="cuda").int()
    tables = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    return Paged(k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"))


def gather_slots(paged: Paged, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [B * length] of every sequence's first `length` positions (padding repeats slot 0)
    and the padding mask [B, 1, 1, length]: the torch backend's decode inputs."""
    pos = torch.arange(length, device="cuda")
    blocks = paged.block_tables.long().gather(
        1, (pos // BLOCK_SIZE).clamp(max=paged.block_tables.shape[1] - 1).expand(
            paged.block_tables.shape[0], -1))
    valid = pos[None, :] < paged.lens[:, None].long()
    slots = torch.where(valid, blocks * BLOCK_SIZE + pos % BLOCK_SIZE, 0)
    return slots.reshape(-1), valid[:, None, None, :]


def torch_decode(q: torch.Tensor, paged: Paged, slots: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """ksana_llm.layers.attention's decode path: gather padded K/V, one SDPA with the query heads
    of a KV head as its query rows."""
    batch, length = q.shape[0], mask.shape[-1]
    k = paged.k_cache.view(-1, KV_HEADS, HEAD_DIM).index_select(0, slots)
    v = paged.v_cache.view(-1, KV_HEADS, HEAD_DIM).index_select(0, slots)
    k = k.view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = v.view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
    qd = q.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    return F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale
                                          ).reshape(batch, HEADS, HEAD_DIM)
