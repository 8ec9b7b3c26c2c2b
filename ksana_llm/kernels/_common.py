"""Argument checks and launch helpers shared by the kernel launchers (torch only, no triton)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ksana_llm.kernels.kv_quant import is_fp8

# tl.dot needs every tile dimension >= 16 when compiled for a GPU (the interpreter accepts less,
# so this floor is what keeps CPU-tested kernels compilable).
MIN_DOT_DIM = 16


class CacheWrite(NamedTuple):
    """Where `apply_rotary_` also writes the rotated K (and V) of the step's tokens: the paged
    cache pair at `slot_mapping`, as `store_kv` would (a cache of K's own dtype, not FP8)."""

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_tile(n: int) -> int:
    """A power-of-two tile covering n that tl.dot accepts."""
    return max(MIN_DOT_DIM, next_pow2(n))


def head_dim_tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DT): the tiles a head of `head_dim` is read in by the attention kernels.

    A power-of-two head is one tile and no tail (BLOCK_DT = 0). Otherwise, when it saves work,
    the head is a power-of-two main tile plus a tail tile, whose products with the keys are
    summed: MLA's 576 = 512 + 64, not one 1024-wide tile (1.8x the QK work, and registers and
    shared memory to match); 96 = 64 + 32, 80 = 64 + 16. Where a split saves nothing (112 =
    64 + 64), the head is one padded tile."""
    padded = dot_tile(head_dim)
    main = 1 << (int(head_dim).bit_length() - 1)  # the largest power of two <= head_dim
    if main == head_dim or main < MIN_DOT_DIM:
        return padded, 0
    tail = dot_tile(head_dim - main)
    if main + tail >= padded:
        return padded, 0
    return main, tail


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs would silently drop to TF32 on tensor cores; keep them exact ("ieee") so fp32
    results match the fp32 reference. 16-bit inputs use the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), "
                         f"got strides {tuple(t.stride())}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(block_size, num_kv_heads, head_dim, v_head_dim) of a K/V cache pair, validated."""
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("k_cache, v_cache: expected [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} does not match k_cache "
                         f"{tuple(k_cache.shape)} in blocks, block size or heads")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"v_cache: dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    check_last_dim_contiguous("k_cache", k_cache)
    check_last_dim_contiguous("v_cache", v_cache)
    return k_cache.shape[1], k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]


def check_cache_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """q must have the cache's dtype, or any float type over an FP8 cache (entries widen to it)."""
    if is_fp8(k_cache.dtype):
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"q: dtype {q.dtype} cannot read an {k_cache.dtype} KV cache")
    elif q.dtype != k_cache.dtype:
        raise ValueError(f"q: dtype {q.dtype} differs from the KV cache's {k_cache.dtype}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def per_head_floats(name: str, values: torch.Tensor | None, num_heads: int
                    ) -> torch.Tensor | None:
    """A per-query-head parameter as the kernels read it, a contiguous fp32 [num_heads] tensor,
    or None."""
    if values is None:
        return None
    if values.shape != (num_heads,):
        raise ValueError(f"{name}: expected shape ({num_heads},), got {tuple(values.shape)}")
    return values.float().contiguous()


def check_alibi(alibi_slopes: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """ALiBi slopes as the kernels read them (fp32 [num_heads]), or None."""
    return per_head_floats("alibi_slopes", alibi_slopes, num_heads)


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Attention-sink logits (GPT-OSS) as the kernels read them (fp32 [num_heads]), or None."""
    return per_head_floats("sinks", sinks, num_heads)


def check_window(sliding_window: int | None) -> int:
    """The window as the kernels take it: 0 = none."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window: must be >= 1 or None, got {sliding_window}")
    return int(sliding_window)


def check_softcap(softcap: float | None) -> float:
    """Attention logit soft-capping as the kernels take it: 0.0 = none."""
    if softcap is None:
        return 0.0
    if not softcap > 0:
        raise ValueError(f"softcap: must be > 0 or None, got {softcap}")
    return float(softcap)
