"""SiLU-gated activation (SwiGLU's `silu(gate) * up`) over a fused gate/up projection, in one
launch.

The torch ops take two launches and a temporary (`silu(gate)` written out, then read back for
the multiply); this reads gate and up once and writes the product. Same roundings as
`layers.activation`'s torch path: silu in fp32 rounded to the dtype, then the product in fp32
rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ksana_llm.kernels._common import check_last_dim_contiguous, next_pow2

# Columns one program takes: the width of a small model's MLP in a few programs per row.
MAX_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(X, Out, cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < cols
    gate = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + cols + c, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + c, (act * up).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate columns, then up columns) -> silu(gate) * up [..., I] in x's dtype."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: expected [..., 2 * I] (gate, then up), got {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    cols = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], cols, dtype=x.dtype, device=x.device)
    if rows.shape[0] and cols:
        block = min(MAX_BLOCK, next_pow2(cols))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(cols, block))](
            rows, out, cols, rows.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], cols)
