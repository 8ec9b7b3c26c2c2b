"""MXFP4 weights (OCP microscaling FP4: GPT-OSS's released expert weights), read on load.

A row of K values is stored as K / 32 blocks: `*_blocks` [..., K / 32, 16] uint8 hold two FP4
(e2m1) codes a byte, the low nibble first, and `*_scales` [..., K / 32] uint8 one power-of-two
exponent per block, biased by 127. The value is e2m1(code) * 2 ** (scale - 127).

`mxfp4_weight` keeps a weight's codes and exponents as they are (a `QuantizedWeight` with `fp4`,
its scales E8M0 bytes): what the expert stacks hold and the grouped MoE kernel reads, half a
byte a number and one byte per 32. `dequantize_mxfp4` gives the plain values.
"""

from __future__ import annotations

import torch

from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.loader.weight_quant import (E8M0_DTYPE, MXFP4_BLOCK, PACKED_INT4_DTYPE,
                                           dequantize_weight)

BLOCK = MXFP4_BLOCK  # values per scale


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: "
                         f"expected [..., G, {BLOCK // 2}] and [..., G]")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`blocks` [..., G, 16] uint8 and `scales` [..., G] uint8 -> values [..., G * 32]."""
    _check(blocks, scales)
    groups = scales.shape[-1]
    shape = (*scales.shape[:-1], groups * BLOCK)
    if blocks.is_meta:  # a dry run: shapes only
        return torch.empty(shape, dtype=dtype, device="meta")
    # Every row as a packed FP4 weight's: e2m1 values times powers of two, exact in float32.
    rows = blocks.reshape(-1, groups * BLOCK // 2)
    values = dequantize_weight(rows, scales.reshape(rows.shape[0], groups), BLOCK, dtype,
                               fp4=True)
    return values.reshape(shape)


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """One [rows, K] MXFP4 weight (`blocks` [rows, K / 32, 16], `scales` [rows, K / 32]) as a
    `QuantizedWeight` of packed FP4 codes (the blocks' bytes, in row order) and the scale
    bytes, one per block of 32: the checkpoint's bytes as they are (see the module doc)."""
    _check(blocks, scales)
    if blocks.dim() != 3:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)}: expected one weight's "
                         f"[rows, K / {BLOCK}, {BLOCK // 2}]")
    rows, groups = scales.shape
    if blocks.is_meta:  # a dry run: shapes only
        return QuantizedWeight(torch.empty(rows, groups * BLOCK // 2, dtype=PACKED_INT4_DTYPE,
                                           device="meta"),
                               torch.empty(rows, groups, dtype=E8M0_DTYPE, device="meta"),
                               BLOCK, fp4=True)
    return QuantizedWeight(blocks.reshape(rows, groups * BLOCK // 2), scales, BLOCK, fp4=True)
