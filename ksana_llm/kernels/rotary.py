"""Rotary position embedding (NeoX rotate-half layout), in place on q and k, optionally after a
per-head RMSNorm (Qwen3's q_norm / k_norm) and followed by the store of K/V into the paged cache.

One program per token rotates all its query and key heads, so cos/sin are read once per token.
Math in fp32, one rounding to the tensor's dtype at the end. The fusions are about launches (at
small batches a decode step's time is mostly launches): a Qwen3 layer's q/k work and K/V store
are one launch instead of six (two copies of the strided q/k views, two norms, the rotation,
the store), a Llama layer's one instead of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ksana_llm.kernels._common import (CacheWrite, check_last_dim_contiguous, check_same_device,
                                       next_pow2)
from ksana_llm.kernels.kv_store import check_store_args


@triton.jit
def _rotate_heads(X, W, Dst, t, stride_t, stride_h, stride_dh, cos, sin, eps, dst_heads,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  REST: tl.constexpr, BLOCK_REST: tl.constexpr, NORM: tl.constexpr,
                  WRITE: tl.constexpr):
    dtype = X.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)
    head_mask = heads < NUM_HEADS
    i = tl.arange(0, BLOCK_HALF)
    mask = head_mask[:, None] & (i < HALF)[None, :]
    ptr1 = X + t * stride_t + heads[:, None] * stride_h + i[None, :]
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr2, mask=mask, other=0.0)
    if REST > 0:  # the head's dims past the rotary dim (read for the norm or the cache write)
        j = tl.arange(0, BLOCK_REST)
        rest_mask = head_mask[:, None] & (j < REST)[None, :]
        ptr3 = X + t * stride_t + heads[:, None] * stride_h + 2 * HALF + j[None, :]
        x3 = tl.load(ptr3, mask=rest_mask, other=0.0)
    if NORM:
        # layers.norm.RMSNorm over the whole head (rotated dims and the rest): normalised in
        # fp32, rounded to the dtype, times the weight, rounded again (the layer's tensor).
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        squares = tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)
        if REST > 0:
            x3f = x3.to(tl.float32)
            squares += tl.sum(x3f * x3f, 1)
        inv_rms = tl.rsqrt(squares / (2 * HALF + REST) + eps)[:, None]
        w1 = tl.load(W + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1f * inv_rms).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (x2f * inv_rms).to(dtype).to(tl.float32)).to(dtype)
        if REST > 0:
            w3 = tl.load(W + 2 * HALF + j, mask=j < REST, other=0.0).to(tl.float32)[None, :]
            x3 = (w3 * (x3f * inv_rms).to(dtype).to(tl.float32)).to(dtype)
            tl.store(ptr3, x3, mask=rest_mask)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    out1 = (x1 * cos - x2 * sin).to(dtype)
    out2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(ptr1, out1, mask=mask)
    tl.store(ptr2, out2, mask=mask)
    if WRITE:  # the same values into the paged cache (dst_heads is 0 for a padding token)
        dst_heads_mask = heads < dst_heads
        dst = Dst + heads[:, None] * stride_dh + i[None, :]
        dst_mask = dst_heads_mask[:, None] & (i < HALF)[None, :]
        tl.store(dst, out1.to(Dst.dtype.element_ty), mask=dst_mask)
        tl.store(dst + HALF, out2.to(Dst.dtype.element_ty), mask=dst_mask)
        if REST > 0:
            tl.store(Dst + heads[:, None] * stride_dh + 2 * HALF + j[None, :],
                     x3.to(Dst.dtype.element_ty),
                     mask=dst_heads_mask[:, None] & (j < REST)[None, :])


@triton.jit
def _rotary_kernel(
    Q, K, V, Cos, Sin, Q_weight, K_weight, K_cache, V_cache, Slots, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_Q_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr,
    NUM_K_HEADS: tl.constexpr, BLOCK_KH: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr, BLOCK_REST: tl.constexpr, NORM: tl.constexpr,
    STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(Cos + t * stride_ct + i, mask=i < HALF, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * stride_st + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(Q, Q_weight, Q, t, stride_qt, stride_qh, 0, cos, sin, eps, 0,
                  NUM_Q_HEADS, BLOCK_QH, HALF, BLOCK_HALF, REST, BLOCK_REST, NORM, False)
    k_dst = K_cache
    dst_heads = 0
    if STORE:  # as kv_store's kernel: int64 slots, a negative slot is a padding token
        slot = tl.load(Slots + t).to(tl.int64)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dst_heads = tl.where(slot >= 0, NUM_K_HEADS, 0)
        k_dst = K_cache + block * stride_kcb + offset * stride_kcs
    _rotate_heads(K, K_weight, k_dst, t, stride_kt, stride_kh, stride_kch, cos, sin, eps,
                  dst_heads, NUM_K_HEADS, BLOCK_KH, HALF, BLOCK_HALF, REST, BLOCK_REST, NORM,
                  STORE)
    if STORE:
        heads = tl.arange(0, BLOCK_KH)
        dv = tl.arange(0, BLOCK_DV)
        v_mask = (heads < dst_heads)[:, None] & (dv < HEAD_DIM_V)[None, :]
        v = tl.load(V + t * stride_vt + heads[:, None] * stride_vh + dv[None, :], mask=v_mask)
        tl.store(V_cache + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch
                 + dv[None, :], v.to(V_cache.dtype.element_ty), mask=v_mask)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
                  eps: float = 1e-6, write_kv: CacheWrite | None = None) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place: for the first R = 2 * cos.shape[-1] dims,
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with x1, x2 the two halves (dims past R are
    left alone; R = D is the usual case). cos / sin: [T, R/2] or [T, 1, R/2] as
    `layers.rotary.RotaryEmbedding.cos_sin` returns them. q and k may be strided views (slices
    of a fused QKV output) with a contiguous last dimension.

    `norm_weights` (q's [D], k's [D], in q's dtype): first RMS-normalise every head over all D
    dims with `eps` and its weight, as `layers.norm.RMSNorm` does (Qwen3's q_norm / k_norm),
    then rotate; the dims past R are normalised too.

    `write_kv`: also store the finished K and the step's V into the paged cache at each token's
    slot (a negative slot is a padding token), which saves the attention its `store_kv` launch.
    The cache must have K's dtype (an FP8 cache goes through `store_kv`, which quantizes)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q, k: expected [T, Hq, D] and [T, Hk, D], "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    num_tokens, head_dim = q.shape[0], q.shape[2]
    half = cos.shape[-1]
    if cos.numel() != num_tokens * half or cos.shape[0] != num_tokens or sin.shape != cos.shape:
        raise ValueError(f"cos, sin: expected [{num_tokens}, R/2] (or [{num_tokens}, 1, R/2]), "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if 2 * half > head_dim:
        raise ValueError(f"cos: rotary dim {2 * half} exceeds head dim {head_dim}")
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k", k)
    q_weight, k_weight = _norm_weights(norm_weights, q, k)
    v, k_cache, v_cache, slots = write_kv if write_kv is not None else (q, q, q, q)
    block_size, v_head_dim = 1, 1
    if write_kv is not None:
        block_size, _, _, v_head_dim = check_store_args(k, v, k_cache, v_cache, slots)
        if k_cache.dtype != k.dtype:
            raise ValueError(f"write_kv: the cache's dtype {k_cache.dtype} is not k's "
                             f"{k.dtype} (store an FP8 cache with store_kv)")
        slots = slots.contiguous()
    if num_tokens == 0:
        return
    # The dims past R are read only for the norm or the cache write (else left alone).
    rest = head_dim - 2 * half if norm_weights is not None or write_kv is not None else 0
    cos2 = cos.reshape(num_tokens, half)
    sin2 = sin.reshape(num_tokens, half)
    if cos2.stride(-1) != 1:
        cos2 = cos2.contiguous()
    if sin2.stride(-1) != 1:
        sin2 = sin2.contiguous()
    _rotary_kernel[(num_tokens,)](
        q, k, v, cos2, sin2, q_weight, k_weight, k_cache, v_cache, slots, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos2.stride(0), sin2.stride(0),
        *_cache_strides(k_cache, write_kv is not None),
        *_cache_strides(v_cache, write_kv is not None),
        NUM_Q_HEADS=q.shape[1], BLOCK_QH=next_pow2(q.shape[1]),
        NUM_K_HEADS=k.shape[1], BLOCK_KH=next_pow2(k.shape[1]),
        HALF=half, BLOCK_HALF=next_pow2(half),
        REST=rest, BLOCK_REST=next_pow2(max(rest, 1)), NORM=norm_weights is not None,
        STORE=write_kv is not None, BLOCK_SIZE=block_size,
        HEAD_DIM_V=v_head_dim, BLOCK_DV=next_pow2(v_head_dim),
        num_warps=4,
    )


def _cache_strides(cache: torch.Tensor, used: bool) -> tuple[int, int, int]:
    """(block, slot, head) strides of a [blocks, block_size, heads, dim] cache; zeros when the
    kernel does not write it."""
    return (cache.stride(0), cache.stride(1), cache.stride(2)) if used else (0, 0, 0)


def _norm_weights(norm_weights: tuple[torch.Tensor, torch.Tensor] | None, q: torch.Tensor,
                  k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q, k) norm weights as the kernel reads them, validated; q and k themselves stand in
    (never read) when there is no norm."""
    if norm_weights is None:
        return q, k
    if len(norm_weights) != 2:
        raise ValueError("norm_weights: expected (q_weight, k_weight)")
    head_dim = q.shape[-1]
    for name, weight in zip(("q", "k"), norm_weights):
        if weight.shape != (head_dim,) or weight.dtype != q.dtype:
            raise ValueError(f"norm_weights: {name}'s weight must be [{head_dim}] in "
                             f"{q.dtype}, got {tuple(weight.shape)} in {weight.dtype}")
        check_same_device(q=q, norm_weight=weight)
    return tuple(w.contiguous() for w in norm_weights)
