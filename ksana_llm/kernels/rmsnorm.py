"""RMSNorm, optionally fused with the residual add before it, one row per program.

Same rounding as `layers.norm.RMSNorm`: x + residual rounded to x's dtype (it is the new residual
stream), normalised in fp32, cast back to x's dtype, then multiplied by the weight in the
promoted dtype of (weight, x) -- Llama's order. With `weight_in_float32` (OLMo 2, GPT-OSS): the
weight multiplies the fp32 normalised row and only the product is cast back, to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ksana_llm.kernels._common import check_last_dim_contiguous, check_same_device, next_pow2


@triton.jit
def _rms_norm_kernel(
    X, Residual, W, Out, New_residual,
    eps, hidden,
    stride_x, stride_r, stride_o, stride_nr,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(New_residual + row * stride_nr + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = xf * inv_rms
    if not WEIGHT_IN_FP32:  # Llama's order: round to x's dtype before the weight multiply
        normed = normed.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor, hidden: int) -> torch.Tensor:
    """t as [rows, hidden] without copying when its rows are evenly strided."""
    check_last_dim_contiguous(name, t)
    try:
        return t.view(-1, hidden)
    except RuntimeError:
        return t.reshape(-1, hidden)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, weight_in_float32: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [..., H] with weight [H].

    Without `residual`: returns norm(x). With it (same shape and dtype as x): returns
    (norm(x + residual), x + residual), like `layers.norm.RMSNorm.forward`. Inputs are not
    modified. `weight_in_float32`: the weight multiplies before the cast back and the result has
    x's dtype (see the module doc)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight: expected shape ({hidden},), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual: expected {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype}")
    check_same_device(x=x, weight=weight, residual=residual)
    weight = weight.contiguous()
    x2 = _rows("x", x, hidden)
    out_dtype = x.dtype if weight_in_float32 else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows("residual", residual, hidden)
        new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
        nr2 = new_residual.view(-1, hidden)
    else:
        r2 = nr2 = x2  # unused
    rows = x2.shape[0]
    if rows:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out2, nr2,
            eps, hidden,
            x2.stride(0), r2.stride(0), out2.stride(0), nr2.stride(0),
            BLOCK=block, HAS_RESIDUAL=residual is not None, WEIGHT_IN_FP32=weight_in_float32,
            # one row of up to a few thousand values: more warps for wider rows
            num_warps=min(16, max(1, block // 512)),
        )
    return out if residual is None else (out, new_residual)
