"""MXFP4 weights (OCP microscaling FP4: GPT-OSS's released expert weights), read on load.

A row of K values is stored as K / 32 blocks: `*_blocks` [..., K / 32, 16] uint8 hold two FP4
(e2m1) codes a byte, the low nibble first, and `*_scales` [..., K / 32] uint8 one power-of-two
exponent per block, biased by 127. The value is e2m1(code) * 2 ** (scale - 127).

Twice an e2m1 value is an integer (0, 1, 2, 3, 4, 6, 8, 12, and their negatives), so a row is
held exactly as int8 codes with one float32 scale per block of 32 (`mxfp4_as_int8`): the form of
an integer checkpoint's weights, which the expert stacks keep and their kernels read at one byte
a number (not yet the half byte of the checkpoint). `dequantize_mxfp4` gives the plain values.
"""

from __future__ import annotations

import torch

from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.loader.weight_quant import INT_WEIGHT_DTYPE

# The sixteen e2m1 values, by code: sign bit, two exponent bits, one mantissa bit.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: "
                         f"expected [..., G, {BLOCK // 2}] and [..., G]")


def _lookup(blocks: torch.Tensor, table: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
    """`table[code]` for every code of `blocks` [..., G, 16], in row order: [..., G, 32]."""
    values = torch.tensor(table, dtype=dtype, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]
    return values[codes].flatten(-2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`blocks` [..., G, 16] uint8 and `scales` [..., G] uint8 -> values [..., G * 32]."""
    _check(blocks, scales)
    shape = (*scales.shape[:-1], scales.shape[-1] * BLOCK)
    if blocks.is_meta:  # a dry run: shapes only
        return torch.empty(shape, dtype=dtype, device="meta")
    values = _lookup(blocks, _E2M1, torch.float32)  # [..., G, 32]
    # Exact in float32: e2m1 values times powers of two (the exponents of real weights are far
    # from float32's range ends).
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.reshape(shape).to(dtype)


def mxfp4_as_int8(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """One [rows, K] MXFP4 weight (`blocks` [rows, K / 32, 16], `scales` [rows, K / 32]) as int8
    codes, twice its e2m1 values, with float32 scales 2 ** (scale - 128) per block of 32: the
    same numbers exactly (see the module doc)."""
    _check(blocks, scales)
    if blocks.dim() != 3:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)}: expected one weight's "
                         f"[rows, K / {BLOCK}, {BLOCK // 2}]")
    rows, groups = scales.shape
    if blocks.is_meta:  # a dry run: shapes only
        return QuantizedWeight(torch.empty(rows, groups * BLOCK, dtype=INT_WEIGHT_DTYPE,
                                           device="meta"),
                               torch.empty(rows, groups, device="meta"), BLOCK)
    codes = _lookup(blocks, tuple(int(2 * v) for v in _E2M1), INT_WEIGHT_DTYPE)
    # 2 ** (scale - 128): exact in float32 for every exponent byte (2 ** -128 a subnormal).
    scale = torch.ldexp(torch.ones(rows, groups, device=blocks.device),
                        scales.to(torch.int32) - 128)
    return QuantizedWeight(codes.reshape(rows, groups * BLOCK), scale, BLOCK)
