"""The paged KV cache's storage: allocation, block copies (swap, fork), and the row gathers
and slot writes the torch attention backend reads and writes it with.

Cache layout: each layer's K (and V) is presented as [num_blocks, block_size, kv_heads, head_dim],
but stored head-major, [num_blocks, kv_heads, block_size, head_dim] (`allocate_kv_cache`). A
gather then copies whole (block, head) rows of block_size * head_dim contiguous values and lands
K/V already in the [batch, heads, tokens, dim] layout attention reads; with token-major storage
the gathered K/V were strided and SDPA ran ~1.7x slower on them (measured on SmolLM2's decode
shapes, 2-core CPU). The Triton kernels take strides, so they read either layout.

An FP8 cache (`EngineConfig.kv_cache_dtype`) stores value / kv_scale rounded to one byte
(`kernels.kv_quant`); every read widens it back to the query's dtype, and a chunk attended
straight from its projection is rounded the same way, so attention always sees cached values.
"""

from __future__ import annotations

import torch

from ksana_llm.kernels.kv_quant import from_cache, raw, to_cache


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                      dtype: torch.dtype, device: torch.device | str = "cpu", zero: bool = True,
                      pin_memory: bool = False) -> torch.Tensor:
    """One layer's K or V cache: a [num_blocks, block_size, kv_heads, head_dim] view of
    head-major storage (see the module doc). `zero=False` leaves the memory uncommitted until
    written (host swap space)."""
    make = torch.zeros if zero else torch.empty
    kwargs = {"pin_memory": True} if pin_memory else {}
    storage = make((num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device,
                   **kwargs)
    return storage.transpose(1, 2)


def block_runs(mapping: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source, destination) block pairs as (first source, first destination, count) runs of
    consecutive blocks on both sides, in order."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in mapping:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def copy_cache_blocks(src: torch.Tensor, dst: torch.Tensor,
                      runs: list[tuple[int, int, int]]) -> None:
    """Copy whole blocks between two caches of `allocate_kv_cache`'s layout (on any devices),
    one contiguous copy per run (`block_runs`), without waiting: between a device and pinned
    host memory each is an asynchronous DMA on the current stream, ordered with the kernels
    around it. (Gathering on the device and scattering on the host would need the data on the
    host first, a wait for everything queued before.)"""
    src_blocks, dst_blocks = src.transpose(1, 2), dst.transpose(1, 2)  # contiguous, block-major
    for first_src, first_dst, count in runs:
        dst_blocks[first_dst:first_dst + count].copy_(src_blocks[first_src:first_src + count],
                                                      non_blocking=True)


def zero_cache_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> None:
    """Set every entry of the blocks `blocks` ([n] int64 on the cache's device) to zero."""
    raw(cache.transpose(1, 2)).index_fill_(0, blocks, 0)


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The [num_blocks * kv_heads, block_size * head_dim] rows behind a cache view."""
    storage = cache.transpose(1, 2)
    if not storage.is_contiguous():
        raise ValueError("KV cache: the torch attention backend needs the head-major layout of "
                         "allocate_kv_cache, got strides " + str(tuple(cache.stride())))
    num_blocks, heads, block_size, dim = storage.shape
    return storage.view(num_blocks * heads, block_size * dim)


def gather_rows(blocks: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Row ids of the head-major cache that hold `blocks` ([..., W]) for every KV head, ordered
    [..., kv_heads, W] so a gather yields [..., kv_heads, W * block_size, head_dim]."""
    heads = torch.arange(num_kv_heads, device=blocks.device)
    return (blocks.unsqueeze(-2) * num_kv_heads + heads[:, None]).reshape(-1)


def gather_kv(cache: torch.Tensor, rows: torch.Tensor, lead: tuple[int, ...], *,
              dtype: torch.dtype | None = None, kv_scale: float = 1.0) -> torch.Tensor:
    """The cache rows `rows` (from `gather_rows`) as [*lead, kv_heads, tokens, head_dim], as
    `dtype` values (default: the cache's dtype; FP8 entries read as entry * kv_scale)."""
    flat = _head_major(cache)
    heads, dim = cache.shape[2], cache.shape[3]
    rows_out = raw(flat).index_select(0, rows).view(cache.dtype).view(*lead, heads, -1, dim)
    return from_cache(rows_out, dtype or cache.dtype, kv_scale)


def store_kv(cache: torch.Tensor, slot_index: tuple[torch.Tensor, torch.Tensor],
             values: torch.Tensor, kv_scale: float = 1.0) -> None:
    """Write values [T, kv_heads, dim] into a cache view at (block ids [T], offsets [T]); an FP8
    cache gets value / kv_scale, rounded."""
    raw(cache)[slot_index] = raw(to_cache(values, cache.dtype, kv_scale))
