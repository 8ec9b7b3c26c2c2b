"""Write a step's new K/V into the paged cache by slot (the `index_copy_` of the torch backend).

Into an FP8 cache the values are scaled and rounded by torch first (`kv_quant.to_cache`), and the
kernel moves bytes: one rounding rule for both backends (triton's interpreter rounds fp32 -> e5m2
differently from the GPU), at the cost of one small elementwise pass over the step's K/V."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ksana_llm.kernels._common import (check_kv_cache, check_last_dim_contiguous,
                                       check_same_device, next_pow2)
from ksana_llm.kernels.kv_quant import is_fp8, to_cache


@triton.jit
def _store_kv_kernel(
    K, V, K_cache, V_cache, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token, all of its KV heads at once.
    t = tl.program_id(0)
    # int64: slot * stride can pass 2**31 elements in a large cache.
    slot = tl.load(Slots + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    # A negative slot is a padding token: no head to write. (One comparison rather than
    # `(heads < NUM_HEADS) & (slot >= 0)`, whose scalar-block `&` the interpreter mistypes.)
    head_mask = heads < tl.where(slot >= 0, NUM_HEADS, 0)

    d = tl.arange(0, BLOCK_D)
    k_mask = head_mask[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=k_mask)
    k_dst = K_cache + block * stride_kcb + offset * stride_kcs
    tl.store(k_dst + heads[:, None] * stride_kch + d[None, :], k.to(K_cache.dtype.element_ty),
             mask=k_mask)

    dv = tl.arange(0, BLOCK_DV)
    v_mask = head_mask[:, None] & (dv < HEAD_DIM_V)[None, :]
    v = tl.load(V + t * stride_vt + heads[:, None] * stride_vh + dv[None, :], mask=v_mask)
    v_dst = V_cache + block * stride_vcb + offset * stride_vcs
    tl.store(v_dst + heads[:, None] * stride_vch + dv[None, :], v.to(V_cache.dtype.element_ty),
             mask=v_mask)


def check_store_args(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor
                     ) -> tuple[int, int, int, int]:
    """(block_size, num_kv_heads, head_dim, v_head_dim) of a store of k, v into the caches at
    slot_mapping, or a ValueError naming the argument that does not fit."""
    block_size, num_kv_heads, head_dim, v_head_dim = check_kv_cache(k_cache, v_cache)
    if k.dim() != 3 or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k: expected [T, {num_kv_heads}, {head_dim}], got {tuple(k.shape)}")
    if v.dim() != 3 or v.shape != (k.shape[0], num_kv_heads, v_head_dim):
        raise ValueError(f"v: expected [{k.shape[0]}, {num_kv_heads}, {v_head_dim}], "
                         f"got {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping: expected shape ({k.shape[0]},), "
                         f"got {tuple(slot_mapping.shape)}")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    return block_size, num_kv_heads, head_dim, v_head_dim


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, kv_scale: float = 1.0) -> None:
    """Write k [T, Hkv, D] and v [T, Hkv, Dv] into k_cache / v_cache
    [num_blocks, block_size, Hkv, D|Dv] at slot_mapping [T] (block * block_size + offset).
    A negative slot skips its token (padding). k and v may be strided views (e.g. slices of a
    fused QKV output) as long as their last dimension is contiguous. An FP8 cache stores
    value / kv_scale (see `kv_quant`)."""
    block_size, num_kv_heads, head_dim, v_head_dim = check_store_args(k, v, k_cache, v_cache,
                                                                       slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    if is_fp8(k_cache.dtype) and k.dtype != k_cache.dtype:
        k, v = to_cache(k, k_cache.dtype, kv_scale), to_cache(v, v_cache.dtype, kv_scale)
    slots = slot_mapping.contiguous()
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_kv_heads, BLOCK_H=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        HEAD_DIM_V=v_head_dim, BLOCK_DV=next_pow2(v_head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4,
    )
