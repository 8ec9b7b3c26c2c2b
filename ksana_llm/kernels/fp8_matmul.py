"""y = x @ (8-bit weight * scales)^T + bias in one launch (W8A16): the weight is read as one
byte per number and widened in registers, so a decode step reads half the bytes of a 16-bit
weight.

The weight is [N, K] float8_e4m3fn (FP8 checkpoints, online quantization) or int8 (integer
checkpoints' codes minus zero points) with float32 scales [N, ceil(K / group_size)] (see
`loader.weight_quant`); x is [M, K] in fp16 / bf16 / fp32 and y comes out in x's dtype.
With one scale per row the scale is applied to the accumulated dot (exact); with group scales
each K tile lies in one group (BLOCK_K divides group_size), so the tile is scaled once before
its dot. Group sizes that no 16-wide tile divides go through the torch reference.

Asymmetric int8 codes come with int8-range zero points (int16), one per scale, subtracted from
the widened tile before its scale. Packed 4-bit codes (W4A16; uint8 [N, K / 2], two codes a
byte, the even column's in the low nibble, int8 zero points beside the scales) take their own
kernel: each byte tile is split into the even and the odd columns' codes, each minus its zero
point, and each half meets x's even or odd columns in its own dot, so a decode step reads a
quarter of a 16-bit weight's bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ksana_llm.kernels._common import check_last_dim_contiguous, check_same_device, dot_precision
from ksana_llm.loader.weight_quant import PACKED_INT4_DTYPE, QUANTIZED_WEIGHT_DTYPES


@triton.jit
def _store_tile(acc, S, Bias, Out, rows, cols, row_ok, col_ok, stride_sn, stride_om,
                PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Both kernels' last step: the row scale (per-row scales), the bias, the store in Out's
    dtype."""
    if PER_ROW:
        row_scale = tl.load(S + cols * stride_sn, mask=col_ok, other=0.0)
        acc = acc * row_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _fp8_linear_kernel(
    X, W, S, Z, Bias, Out,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    GROUP: tl.constexpr, PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if HAS_ZERO:  # asymmetric int8 codes: the zero point of the tile's group (or row)
            zero = tl.load(Z + cols * stride_zn + (0 if PER_ROW else k0 // GROUP), mask=col_ok,
                           other=0).to(tl.float32)
            w = w - zero[:, None]
        if not PER_ROW:
            group_scale = tl.load(S + cols * stride_sn + k0 // GROUP, mask=col_ok, other=0.0)
            w = w * group_scale[:, None]
        acc += tl.dot(x, tl.trans(w.to(X.dtype.element_ty)), input_precision=PRECISION)
    _store_tile(acc, S, Bias, Out, rows, cols, row_ok, col_ok, stride_sn, stride_om,
                PER_ROW, HAS_BIAS)


@triton.jit
def _int4_linear_kernel(
    X, W, S, Z, Bias, Out,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    GROUP: tl.constexpr, PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.arange(0, BLOCK_K // 2)  # byte j of a tile holds columns 2j and 2j + 1
    row_ok = rows < M
    col_ok = cols < N
    x_rows = X + rows[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        even = k0 + 2 * pairs
        pair_ok = even < K  # K is even: a byte is whole or absent
        x_mask = row_ok[:, None] & pair_ok[None, :]
        x_even = tl.load(x_rows + even[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + even[None, :] + 1, mask=x_mask, other=0.0)
        codes = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + (k0 // 2 + pairs)[None, :],
                        mask=col_ok[:, None] & pair_ok[None, :], other=0)
        group = 0 if PER_ROW else k0 // GROUP
        zero = tl.load(Z + cols * stride_zn + group, mask=col_ok, other=0).to(tl.float32)
        w_even = (codes & 0xF).to(tl.float32) - zero[:, None]
        w_odd = (codes >> 4).to(tl.float32) - zero[:, None]
        if not PER_ROW:
            group_scale = tl.load(S + cols * stride_sn + group, mask=col_ok, other=0.0)
            w_even = w_even * group_scale[:, None]
            w_odd = w_odd * group_scale[:, None]
        acc += tl.dot(x_even, tl.trans(w_even.to(X.dtype.element_ty)), input_precision=PRECISION)
        acc += tl.dot(x_odd, tl.trans(w_odd.to(X.dtype.element_ty)), input_precision=PRECISION)
    _store_tile(acc, S, Bias, Out, rows, cols, row_ok, col_ok, stride_sn, stride_om,
                PER_ROW, HAS_BIAS)


def kernel_block_k(group_size: int, per_row: bool, packed: bool = False) -> int | None:
    """The K tile: 64 (or 32, 16) dividing the group, so each tile has one scale; None when no
    16-wide tile divides it. Packed 4-bit tiles are at least 32 wide (two dots of half the tile,
    each at least 16 deep)."""
    if per_row:
        return 64
    for block in (64, 32) if packed else (64, 32, 16):
        if group_size % block == 0:
            return block
    return None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_size: int,
               bias: torch.Tensor | None = None, zero_point: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [..., K] times the quantized weight [N, K] (scales [N, groups]) -> [..., N] in x's
    dtype: 8-bit values (int8 codes with an optional `zero_point` [N, groups]: asymmetric
    checkpoints), or packed 4-bit codes (uint8 [N, K / 2]) with their `zero_point`s."""
    packed = weight.dtype == PACKED_INT4_DTYPE
    if not (packed or weight.dtype in QUANTIZED_WEIGHT_DTYPES) or weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D tensor of {QUANTIZED_WEIGHT_DTYPES} or packed "
                         f"4-bit codes (uint8), got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * (2 if packed else 1)
    if x.shape[-1] != k:
        raise ValueError(f"x: last dim {x.shape[-1]} does not match the weight's {k} columns")
    if (packed and zero_point is None) or (zero_point is not None and (
            zero_point.shape != scale.shape or weight.dtype == QUANTIZED_WEIGHT_DTYPES[0])):
        raise ValueError("zero_point: packed 4-bit codes need one zero point per scale, and "
                         "zero points come one per scale")
    per_row = scale.shape[1] == 1
    block_k = kernel_block_k(group_size, per_row, packed)
    if block_k is None:
        raise ValueError(f"group_size {group_size}: the kernel needs a multiple of "
                         f"{32 if packed else 16}")
    check_same_device(x=x, weight=weight, scale=scale, bias=bias, zero_point=zero_point)
    check_last_dim_contiguous("weight", weight)
    x2 = x.reshape(-1, k)
    check_last_dim_contiguous("x", x2)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        # Decode batches are a few rows: a 16-row tile wastes the least of each weight tile
        # read, and narrower column tiles give more programs to spread the weight's bytes over
        # the SMs (one program per 32 output columns). Not tuned on a GPU yet.
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n = 32 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        scale = scale.to(torch.float32).contiguous()
        # per row, GROUP is unused: one value, so one compiled kernel for every K
        tiles = dict(GROUP=1 if per_row else group_size, PER_ROW=per_row,
                     HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                     BLOCK_K=block_k, PRECISION=dot_precision(x.dtype))
        bias_arg = bias if bias is not None else scale
        zero_arg = zero_point.contiguous() if zero_point is not None else scale
        if packed:
            _int4_linear_kernel[grid](
                x2, weight, scale, zero_arg, bias_arg, out, m, n, k,
                x2.stride(0), weight.stride(0), scale.stride(0), zero_arg.stride(0),
                out.stride(0), **tiles)
        else:
            _fp8_linear_kernel[grid](
                x2, weight, scale, zero_arg, bias_arg, out, m, n, k,
                x2.stride(0), weight.stride(0), scale.stride(0), zero_arg.stride(0),
                out.stride(0), HAS_ZERO=zero_point is not None, **tiles)
    return out.view(*x.shape[:-1], n)
