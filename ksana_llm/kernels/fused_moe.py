"""Mixture-of-experts matmuls with one launch per weight stack, and no host sync.

The torch path (`layers.moe.FusedExperts`) reads each expert's token count back to the host and
launches one matmul pair per active expert: a decode step of a 128-expert model makes hundreds
of launches per layer, and cannot be captured in a CUDA graph. Here routing is turned into
fixed-size index tensors on the device, and one launch covers every expert:

- `align_to_experts(experts, num_experts, block_m)`: the (token, k) assignments grouped by
  expert, each expert's run padded to a multiple of `block_m`, so every block of `block_m` rows
  belongs to one expert. The buffers are sized for the worst case (each of the
  min(assignments, experts) active experts wasting block_m - 1 rows), so their shapes depend on
  the batch's size only: a captured graph replays them for any routing. Blocks past the used
  ones are marked -1.
- `expert_matmul(a, weight, blocks, rows_per_input)`: out[i] = a[i // rows_per_input] @
  weight[expert of i]^T for every assignment i, one program per (block, column tile); a program
  whose block is unused returns at once. With `rows_per_input = top_k` the tokens' hidden states
  feed the gate/up stack directly (no gathered copy); with 1, the per-assignment activations
  feed the down stack.

Weights are dense (the activations' dtype), 8-bit (FP8 E4M3, or int8 codes with optional zero
points) or packed 4-bit codes (uint8 [E, N, K / 2]: integers with their zero points, or MXFP4's
e2m1 values, decoded arithmetically in registers), with float32 scales [E, N, groups] as
`FusedExperts` keeps them (MXFP4's: E8M0 exponent bytes, made powers of two in registers):
widened in registers as in `fp8_matmul` (group
scales on each K tile before its dot, a per-row scale on the accumulated dot), so a decode step
reads one byte, or half a byte, per weight. Experts in GPTQ's activation order gather their
input columns in their own order (`input_order` [E, K]) as they load them. Tile sizes follow the
rows per expert; not tuned on a GPU yet.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ksana_llm.kernels._common import check_last_dim_contiguous, check_same_device, dot_precision
from ksana_llm.kernels.fp8_matmul import kernel_block_k
from ksana_llm.loader.weight_quant import (E8M0_DTYPE, PACKED_INT4_DTYPE,
                                           QUANTIZED_WEIGHT_DTYPES)


class ExpertBlocks(NamedTuple):
    """Routing as `expert_matmul` reads it (see the module docstring)."""
    assignment_ids: torch.Tensor  # [capacity] int32: t * top_k + k, padding = num_assignments
    block_experts: torch.Tensor  # [capacity // block_m] int32: a block's expert, -1 = unused
    block_m: int
    num_assignments: int


def expert_block_size(num_assignments: int, num_experts: int) -> int:
    """Rows per block: about the rows an expert gets on average (a decode step's few, a
    prefill's many), at least 16 (tl.dot's floor) and at most 64."""
    per_expert = num_assignments / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def expert_block_capacity(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Rows that hold any routing of `num_assignments` over `num_experts` in blocks of
    `block_m`: each active expert pads its run by at most block_m - 1."""
    bound = num_assignments + min(num_assignments, num_experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_to_experts(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Group the assignments in `experts` [T, K] (expert ids) by expert, in blocks of `block_m`
    rows; torch ops with no host sync (scatter_add rather than bincount, which reads its
    input's maximum back)."""
    if experts.dim() != 2:
        raise ValueError(f"experts: expected [tokens, top_k], got {tuple(experts.shape)}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    device = experts.device
    flat = experts.reshape(-1).long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    first_unpadded = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # assignments by expert, in token order within one
    by_expert = flat[order]
    rank = torch.arange(n, device=device) - first_unpadded[by_expert]  # place in its expert's run
    slot = padded_ends[by_expert] - padded[by_expert] + rank
    capacity = expert_block_capacity(n, num_experts, block_m)
    ids = torch.full((capacity,), n, dtype=torch.int32, device=device)
    ids[slot] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    owner = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return ExpertBlocks(ids, block_experts, block_m, n)


@triton.jit
def _load_inputs(A, a_rows, row_ok, k, k_ok, stride_am, order, ORDERED: tl.constexpr):
    """Rows `a_rows` of A at columns k, or at the columns `order` puts there (activation order)."""
    if ORDERED:
        k = tl.load(order + k, mask=k_ok, other=0)
    return tl.load(A + a_rows[:, None] * stride_am + k[None, :],
                   mask=row_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _program_tile(Ids, BlockExperts, W, S, num_assignments, N,
                  stride_we, stride_wn, stride_se, stride_sn,
                  ROWS_PER_INPUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: its block's expert (-1: unused, nothing else then matters), the
    block's assignment ids with their A rows and validity (padding rows of the expert's last
    block are not), and the column tile with its weight rows and scales."""
    block = tl.program_id(0)
    expert = tl.load(BlockExperts + block).to(tl.int64)
    ids = tl.load(Ids + block * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (expert, ids, (ids // ROWS_PER_INPUT).to(tl.int64), ids < num_assignments, cols,
            cols < N, W + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn,
            S + expert * stride_se + cols * stride_sn)


@triton.jit
def _load_scales(pointers, mask, E8M0: tl.constexpr):
    """Scales as float32: as stored, or from E8M0 bytes (MXFP4): 2 ** (byte - 127), built as
    float32 bits so every byte is exact -- 0 the subnormal 2 ** -127, 255 NaN."""
    # One return after an if / else: triton compiles every return of a function, even one
    # past a constexpr branch that returned, and they must agree in type.
    if E8M0:
        byte = tl.load(pointers, mask=mask, other=127).to(tl.int32)
        bits = tl.where(byte == 0, 1 << 22, byte << 23)
        bits = tl.where(byte == 255, 0x7FC00000, bits)
        scales = bits.to(tl.float32, bitcast=True)
    else:
        scales = tl.load(pointers, mask=mask, other=0.0)
    return scales


@triton.jit
def _store_rows(acc, scales, Out, ids, cols, row_ok, col_ok, stride_om, PER_ROW: tl.constexpr,
                E8M0: tl.constexpr):
    """Both kernels' last step: the per-row scale (where the weight has one), the store."""
    if PER_ROW:
        acc = acc * _load_scales(scales, col_ok, E8M0)[None, :]
    tl.store(Out + ids[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _expert_matmul_kernel(
    A, W, S, Z, Order, Out, Ids, BlockExperts,
    num_assignments, N, K,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn, stride_oe,
    stride_om,
    ROWS_PER_INPUT: tl.constexpr, QUANTIZED: tl.constexpr, GROUP: tl.constexpr,
    PER_ROW: tl.constexpr, HAS_ZERO: tl.constexpr, ORDERED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    expert, ids, a_rows, row_ok, cols, col_ok, w_rows, scales = _program_tile(
        Ids, BlockExperts, W, S, num_assignments, N, stride_we, stride_wn, stride_se, stride_sn,
        ROWS_PER_INPUT, BLOCK_M, BLOCK_N)
    if expert < 0:  # past the blocks this routing uses
        return
    ks = tl.arange(0, BLOCK_K)
    order = Order + expert * stride_oe
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = _load_inputs(A, a_rows, row_ok, k, k_ok, stride_am, order, ORDERED)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANTIZED:  # 8-bit values widened in registers; this K tile lies in one group
            w = w.to(tl.float32)
            if HAS_ZERO:
                zero = tl.load(Z + expert * stride_ze + cols * stride_zn
                               + (0 if PER_ROW else k0 // GROUP), mask=col_ok, other=0)
                w = w - zero.to(tl.float32)[:, None]
            if not PER_ROW:
                w = w * tl.load(scales + k0 // GROUP, mask=col_ok, other=0.0)[:, None]
            w = w.to(A.dtype.element_ty)
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    _store_rows(acc, scales, Out, ids, cols, row_ok, col_ok, stride_om, QUANTIZED and PER_ROW,
                False)


@triton.jit
def _e2m1(codes):
    """FP4 (e2m1) codes 0..15 -> their values in float32 (`weight_quant.E2M1_VALUES`)."""
    c = codes.to(tl.int32)
    exponent = (c >> 1) & 3
    mantissa = c & 1
    # In quarters: 2m when the exponent is 0 (0 and 0.5), else (2 + m) << exponent.
    quarters = tl.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent)
    magnitude = quarters.to(tl.float32) * 0.25
    return tl.where((c & 8) != 0, -magnitude, magnitude)


@triton.jit
def _expert_int4_matmul_kernel(
    A, W, S, Z, Order, Out, Ids, BlockExperts,
    num_assignments, N, K,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn, stride_oe,
    stride_om,
    ROWS_PER_INPUT: tl.constexpr, GROUP: tl.constexpr, PER_ROW: tl.constexpr,
    ORDERED: tl.constexpr, FP4: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Packed 4-bit codes, as `fp8_matmul._int4_linear_kernel` reads them: each byte tile split
    into the even and the odd columns' codes, each meeting its own input columns in a dot.
    `FP4`: the codes are e2m1 values (MXFP4), with no zero points, and the scales E8M0 bytes."""
    expert, ids, a_rows, row_ok, cols, col_ok, w_rows, scales = _program_tile(
        Ids, BlockExperts, W, S, num_assignments, N, stride_we, stride_wn, stride_se, stride_sn,
        ROWS_PER_INPUT, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    pairs = tl.arange(0, BLOCK_K // 2)  # byte j of a tile holds columns 2j and 2j + 1
    zeros = Z + expert * stride_ze + cols * stride_zn
    order = Order + expert * stride_oe
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        even = k0 + 2 * pairs
        pair_ok = even < K  # K is even: a byte is whole or absent
        x_even = _load_inputs(A, a_rows, row_ok, even, pair_ok, stride_am, order, ORDERED)
        x_odd = _load_inputs(A, a_rows, row_ok, even + 1, pair_ok, stride_am, order, ORDERED)
        codes = tl.load(w_rows + (k0 // 2 + pairs)[None, :],
                        mask=col_ok[:, None] & pair_ok[None, :], other=0)
        group = 0 if PER_ROW else k0 // GROUP
        if FP4:
            w_even = _e2m1(codes & 0xF)
            w_odd = _e2m1(codes >> 4)
        else:
            zero = tl.load(zeros + group, mask=col_ok, other=0).to(tl.float32)
            w_even = (codes & 0xF).to(tl.float32) - zero[:, None]
            w_odd = (codes >> 4).to(tl.float32) - zero[:, None]
        if not PER_ROW:
            group_scale = _load_scales(scales + group, col_ok, FP4)
            w_even = w_even * group_scale[:, None]
            w_odd = w_odd * group_scale[:, None]
        acc += tl.dot(x_even, tl.trans(w_even.to(A.dtype.element_ty)), input_precision=PRECISION)
        acc += tl.dot(x_odd, tl.trans(w_odd.to(A.dtype.element_ty)), input_precision=PRECISION)
    _store_rows(acc, scales, Out, ids, cols, row_ok, col_ok, stride_om, PER_ROW, FP4)


def grouped_block_k(weight_dtype: torch.dtype, group_size: int, per_row: bool) -> int | None:
    """The K tile `expert_matmul` takes for these weights, None when it cannot take them
    (group sizes no 16-wide tile divides; 32 for packed 4-bit codes)."""
    if weight_dtype in QUANTIZED_WEIGHT_DTYPES or weight_dtype == PACKED_INT4_DTYPE:
        return kernel_block_k(group_size, per_row, weight_dtype == PACKED_INT4_DTYPE)
    if weight_dtype.is_floating_point:
        return 32 if weight_dtype == torch.float32 else 64
    return None


def expert_matmul(a: torch.Tensor, weight: torch.Tensor, blocks: ExpertBlocks,
                  rows_per_input: int, scale: torch.Tensor | None = None, group_size: int = 0,
                  zero_point: torch.Tensor | None = None,
                  input_order: torch.Tensor | None = None, *, fp4: bool = False) -> torch.Tensor:
    """a [R, K] times each assignment's expert of `weight` [E, N, K] -> [assignments, N] in a's
    dtype: row i is a[i // rows_per_input] @ weight[expert(i)]^T (see the module docstring).
    Quantized weights (8-bit values, or packed 4-bit codes [E, N, K / 2]) come with float32
    `scale`s [E, N, groups] in groups of `group_size` columns and, for packed integer and
    asymmetric int8 codes, `zero_point`s shaped like the scales; `fp4`: the packed codes are
    e2m1 values (MXFP4), with no zero points and E8M0 scale bytes (uint8,
    `weight_quant.e8m0_scales`); `input_order` [E, K]: expert e's column j multiplies
    a[:, input_order[e, j]]."""
    packed = weight.dtype == PACKED_INT4_DTYPE
    if fp4 and (not packed or zero_point is not None or scale is None
                or scale.dtype != E8M0_DTYPE):
        raise ValueError(f"fp4: packed codes (uint8) with E8M0 scales (uint8) and no zero "
                         f"points expected, got {weight.dtype} codes, "
                         f"{None if scale is None else scale.dtype} scales"
                         f"{' and zero points' if zero_point is not None else ''}")
    k = weight.shape[-1] * (2 if packed else 1)
    if weight.dim() != 3 or a.dim() != 2 or a.shape[1] != k:
        raise ValueError(f"a [rows, K] and weight [experts, N, K] (K / 2 bytes packed) expected, "
                         f"got {tuple(a.shape)} and {tuple(weight.shape)}")
    if not a.dtype.is_floating_point:
        raise ValueError(f"a: a floating dtype expected, got {a.dtype}")
    quantized = scale is not None
    if quantized != (packed or weight.dtype in QUANTIZED_WEIGHT_DTYPES) or (
            not quantized and weight.dtype != a.dtype):
        raise ValueError(f"weight: {weight.dtype} needs a's dtype {a.dtype} (dense) or 8-bit "
                         f"values {QUANTIZED_WEIGHT_DTYPES} / packed 4-bit codes with their "
                         "scales")
    if quantized and (scale.dim() != 3 or scale.shape[:2] != weight.shape[:2] or (
            zero_point is not None and zero_point.shape != scale.shape)):
        raise ValueError(f"scale: expected [experts, N, groups] for weight "
                         f"{tuple(weight.shape)} (zero points alike), got {tuple(scale.shape)}")
    if packed and zero_point is None and not fp4:
        raise ValueError("zero_point: packed 4-bit integer codes need one zero point per scale")
    if input_order is not None and input_order.shape != (weight.shape[0], k):
        raise ValueError(f"input_order: expected [experts, K] = {(weight.shape[0], k)}, got "
                         f"{tuple(input_order.shape)}")
    per_row = quantized and scale.shape[2] == 1
    block_k = grouped_block_k(weight.dtype, group_size, per_row)
    if block_k is None:
        raise ValueError(f"group_size {group_size}: the kernel needs a multiple of "
                         f"{32 if packed else 16}")
    if a.shape[0] * rows_per_input != blocks.num_assignments:
        raise ValueError(f"a: {a.shape[0]} rows x {rows_per_input} per row != "
                         f"{blocks.num_assignments} assignments")
    check_same_device(a=a, weight=weight, ids=blocks.assignment_ids, scale=scale,
                      zero_point=zero_point, input_order=input_order)
    check_last_dim_contiguous("a", a)
    check_last_dim_contiguous("weight", weight)
    n = weight.shape[1]
    out = torch.empty(blocks.num_assignments, n, dtype=a.dtype, device=a.device)
    num_blocks = blocks.block_experts.numel()
    if num_blocks:
        # unread when dense; E8M0 bytes as they are (the kernel decodes them)
        scale_arg = (scale if fp4 else scale.float()).contiguous() if quantized else out
        zero_arg = zero_point.contiguous() if zero_point is not None else scale_arg
        order_arg = input_order.contiguous() if input_order is not None else blocks.assignment_ids
        block_n = 64 if blocks.block_m <= 32 else 128
        grid = (num_blocks, triton.cdiv(n, block_n))
        args = (a, weight, scale_arg, zero_arg, order_arg, out, blocks.assignment_ids,
                blocks.block_experts, blocks.num_assignments, n, k,
                a.stride(0), weight.stride(0), weight.stride(1),
                scale_arg.stride(0), scale_arg.stride(1), zero_arg.stride(0), zero_arg.stride(1),
                order_arg.stride(0), out.stride(0))
        # GROUP: one value when unused, so one compiled kernel serves every K
        tiles = dict(ROWS_PER_INPUT=rows_per_input,
                     GROUP=group_size if quantized and not per_row else 1, PER_ROW=per_row,
                     ORDERED=input_order is not None, BLOCK_M=blocks.block_m, BLOCK_N=block_n,
                     BLOCK_K=block_k, PRECISION=dot_precision(a.dtype))
        if packed:
            _expert_int4_matmul_kernel[grid](*args, FP4=fp4, **tiles)
        else:
            _expert_matmul_kernel[grid](*args, QUANTIZED=quantized,
                                        HAS_ZERO=zero_point is not None, **tiles)
    return out
