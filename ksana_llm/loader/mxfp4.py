"""MXFP4 weights (OCP microscaling FP4: GPT-OSS's released expert weights), dequantized on load.

A row of K values is stored as K / 32 blocks: `*_blocks` [..., K / 32, 16] uint8 hold two FP4
(e2m1) codes a byte, the low nibble first, and `*_scales` [..., K / 32] uint8 one power-of-two
exponent per block, biased by 127. The value is e2m1(code) * 2 ** (scale - 127).
"""

from __future__ import annotations

import torch

# The sixteen e2m1 values, by code: sign bit, two exponent bits, one mantissa bit.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`blocks` [..., G, 16] uint8 and `scales` [..., G] uint8 -> values [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: "
                         f"expected [..., G, {BLOCK // 2}] and [..., G]")
    shape = (*scales.shape[:-1], scales.shape[-1] * BLOCK)
    if blocks.is_meta:  # a dry run: shapes only
        return torch.empty(shape, dtype=dtype, device="meta")
    table = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]
    values = table[codes].flatten(-2)  # [..., G, 32]
    # Exact in float32: e2m1 values times powers of two (the exponents of real weights are far
    # from float32's range ends).
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.reshape(shape).to(dtype)
