"""Rotary position embedding (NeoX rotate-half layout), in place on q and k.

One program per token rotates all its query and key heads, so cos/sin are read once per token.
Math in fp32, one rounding to the tensor's dtype at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ksana_llm.kernels._common import check_last_dim_contiguous, check_same_device, next_pow2


@triton.jit
def _rotate_heads(X, t, stride_t, stride_h, cos, sin,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (heads < NUM_HEADS)[:, None] & (i < HALF)[None, :]
    ptr1 = X + t * stride_t + heads[:, None] * stride_h + i[None, :]
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(ptr2, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    NUM_Q_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr,
    NUM_K_HEADS: tl.constexpr, BLOCK_KH: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(Cos + t * stride_ct + i, mask=i < HALF, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * stride_st + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(Q, t, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, BLOCK_QH, HALF, BLOCK_HALF)
    _rotate_heads(K, t, stride_kt, stride_kh, cos, sin, NUM_K_HEADS, BLOCK_KH, HALF, BLOCK_HALF)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place: for the first R = 2 * cos.shape[-1] dims,
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with x1, x2 the two halves (dims past R are
    left alone; R = D is the usual case). cos / sin: [T, R/2] or [T, 1, R/2] as
    `layers.rotary.RotaryEmbedding.cos_sin` returns them. q and k may be strided views (slices
    of a fused QKV output) with a contiguous last dimension."""
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
    if num_tokens == 0:
        return
    cos2 = cos.reshape(num_tokens, half)
    sin2 = sin.reshape(num_tokens, half)
    if cos2.stride(-1) != 1:
        cos2 = cos2.contiguous()
    if sin2.stride(-1) != 1:
        sin2 = sin2.contiguous()
    _rotary_kernel[(num_tokens,)](
        q, k, cos2, sin2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos2.stride(0), sin2.stride(0),
        NUM_Q_HEADS=q.shape[1], BLOCK_QH=next_pow2(q.shape[1]),
        NUM_K_HEADS=k.shape[1], BLOCK_KH=next_pow2(k.shape[1]),
        HALF=half, BLOCK_HALF=next_pow2(half),
        num_warps=4,
    )
