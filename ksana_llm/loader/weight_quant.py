"""Quantized weights as numbers: quantizing a weight to FP8 values with float32 scales, and back
(torch only, no triton; the loader, the layers and the Triton W8A16 matmul share these).

A weight is `data * scale`: `data` one byte per number, each scale covering a tile of it (a
checkpoint's [128, 128] blocks, or one row of `group_size` columns in memory). `data` is
float8_e4m3fn for FP8 checkpoints and online quantization (a tile's largest magnitude maps to
E4M3's largest finite value, 448), or int8 for integer checkpoints (GPTQ, AWQ,
compressed-tensors int8), whose codes minus zero points it holds exactly (asymmetric ones, whose
codes lie up to 255 from their zero point: the codes and zero points both minus 128, a weight
being `(codes - zero_point) * scale`). 4-bit checkpoints keep half a byte per number: `data` is
uint8 holding two 4-bit codes (0..15), with one int8 zero point per scale -- or two FP4 (e2m1)
codes (MXFP4 checkpoints: `E2M1_VALUES`), which have no zero points and whose power-of-two
scales stay one byte each, as the checkpoints store them (E8M0 exponents, `e8m0_scales`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_WEIGHT_DTYPE).max  # 448
INT_WEIGHT_DTYPE = torch.int8
# What a quantized weight's `data` may be: FP8 values or integer codes (see the module's doc).
QUANTIZED_WEIGHT_DTYPES = (FP8_WEIGHT_DTYPE, INT_WEIGHT_DTYPE)
# Two 4-bit codes per byte, the even column's in the low nibble (the order of the checkpoints'
# int32 words, read byte by byte).
PACKED_INT4_DTYPE = torch.uint8
# The sixteen e2m1 (FP4) values, by code: sign bit, two exponent bits, one mantissa bit. Twice
# each is an integer, so int8 codes hold them exactly (`QuantizedWeight.unpacked`).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# Symmetric int8 as compressed-tensors computes it (W8A8's weights and activations): a row's
# largest magnitude maps to this many steps, (127 - (-128)) / 2, and codes clamp to [-128, 127].
INT8_HALF_RANGE = 127.5


def quantize_int8_rows(values: torch.Tensor, absmax: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes (`values`' shape) and float32 scales ([..., 1]) of each row (the last dim):
    scale = the row's largest magnitude (`absmax` when given) / 127.5, codes = round(value /
    scale) clamped, computed in float32. An all-zero row keeps scale 1 (its codes are zero
    either way)."""
    if absmax is None:
        absmax = values.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = absmax / INT8_HALF_RANGE
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(values.float() / scale).clamp_(-128, 127).to(INT_WEIGHT_DTYPE)
    return codes, scale


# E4M3 value / E4M3_AS_HALF_FACTOR is what `e4m3_as_half` returns.
E4M3_AS_HALF_FACTOR = 256.0


def e4m3_as_half(data: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes moved into float16's fields (sign to bit 15; exponent and mantissa, 7 bits, to
    bits 13..7): float16 numbers exactly 1/256 of the E4M3 values, subnormals included (both
    formats scale theirs the same way). Three integer passes instead of torch's E4M3 widening,
    which is about 6x slower than E5M2's on a CPU. E4M3's NaN bytes come out finite (480):
    quantized weights never hold NaN."""
    bits = data.view(torch.uint8).to(torch.int16)
    return ((bits & 0x80) << 8 | (bits & 0x7F) << 7).view(torch.float16)


# Halfway points between the non-negative e2m1 values, and those of them a tie rounds up from
# (to the even code: 0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0); other ties round down.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)
MXFP4_BLOCK = 32  # values per power-of-two scale
E2M1_MAX_EXPONENT = 2  # the largest e2m1 value, 6, is 1.5 * 2 ** 2
# An MXFP4 scale is one E8M0 byte: the exponent of a power of two plus this bias (127 is 1.0);
# the byte 255 is NaN. A quarter of a float32 scale's memory: on gpt-oss-120b's experts, 3.6 GB
# rather than 14 GB.
E8M0_DTYPE = torch.uint8
E8M0_BIAS = 127
E8M0_NAN = 255


def e8m0_scales(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes as float32: 2 ** (byte - 127), exact for every byte (2 ** -127 a
    subnormal), and NaN for 255."""
    if exponents.dtype != E8M0_DTYPE:
        raise ValueError(f"E8M0 scales are uint8 exponent bytes, got {exponents.dtype}")
    powers = torch.ldexp(torch.ones(exponents.shape, device=exponents.device),
                         exponents.to(torch.int32) - E8M0_BIAS)
    return powers.masked_fill_(exponents == E8M0_NAN, torch.nan)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rows, cols] weight (cols a multiple of 32) as MXFP4, the OCP microscaling rule:
    each block of 32 gets the scale 2 ** (floor(log2(its largest magnitude)) - 2), and each
    value divided by it rounds to the nearest e2m1 value (ties to the even code), 6 at most.
    Returns (packed codes uint8 [rows, cols / 2], the low nibble first; E8M0 scale bytes
    [rows, cols / 32], `e8m0_scales`). Values that are MXFP4 numbers already come back
    exactly; a block with NaN or an infinity comes back all NaN."""
    rows, cols = weight.shape
    if cols % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs a multiple of {MXFP4_BLOCK} columns, got {cols}")
    if weight.is_meta:  # a dry run: shapes only
        return (torch.empty(rows, cols // 2, dtype=PACKED_INT4_DTYPE, device="meta"),
                torch.empty(rows, cols // MXFP4_BLOCK, dtype=E8M0_DTYPE, device="meta"))
    # contiguous: a transposed weight would otherwise keep its strides through the arithmetic
    blocks = weight.float().contiguous().reshape(rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    largest = blocks.abs().amax(dim=-1)
    # frexp: largest = m * 2 ** e with m in [0.5, 1), so floor(log2(largest)) = e - 1 (exact,
    # unlike log2 in floating point); an all-zero block takes any scale (1 here).
    _, exponent = torch.frexp(largest)
    exponent = torch.where(largest > 0, exponent - 1 - E2M1_MAX_EXPONENT, 0).clamp(-127, 127)
    # A block holding NaN or an infinity gets a NaN scale (the OCP rule), so it reads back NaN
    # as a dense weight would, rather than as finite numbers.
    scale = torch.where(largest.isfinite(), torch.ldexp(torch.ones_like(largest), exponent),
                        torch.nan)
    scaled = blocks / scale.unsqueeze(-1)
    magnitude = scaled.abs()
    midpoints = torch.tensor(_E2M1_MIDPOINTS, device=weight.device)
    index = torch.bucketize(magnitude, midpoints)  # ties round down, here
    ties_up = torch.isin(magnitude, torch.tensor(_E2M1_TIES_UP, device=weight.device))
    codes = (index + ties_up.long()).clamp(max=7) | torch.where(scaled < 0, 8, 0)
    biased = torch.where(largest.isfinite(), exponent + E8M0_BIAS, E8M0_NAN)
    return pack_nibbles(codes.reshape(rows, cols)), biased.to(E8M0_DTYPE)


def e2m1_codes(data: torch.Tensor, table: tuple[float, ...] = E2M1_VALUES,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`table[code]` for the packed FP4 codes of `data` [rows, n] uint8: [rows, 2n]."""
    values = torch.tensor(table, dtype=dtype, device=data.device)
    return values[split_nibbles(data).long()]


def dequantize_weight(data: torch.Tensor, scale: torch.Tensor, group_size: int,
                      dtype: torch.dtype = torch.float32,
                      zero_point: torch.Tensor | None = None, fp4: bool = False) -> torch.Tensor:
    """8-bit values (FP8 or int8) or packed 4-bit codes, minus their `zero_point`s where given
    (packed integer codes always; asymmetric int8 codes), times their group scales (computed in
    float32, then cast once to `dtype`). `fp4`: the packed codes are e2m1 values, the scales
    E8M0 bytes (`e8m0_scales`)."""
    if fp4:
        weight = e2m1_codes(data)
        scale = e8m0_scales(scale)
    elif data.dtype == PACKED_INT4_DTYPE:
        if zero_point is None:
            raise ValueError("packed 4-bit codes need their zero points")
        # Codes 0..15 minus their zero points fit int8 (`int4_weight` packs only zero points
        # that keep them so): subtracted at one byte a number, before widening.
        values = split_nibbles(data).view(torch.int8)
        _per_group(values, zero_point.to(torch.int8), group_size, torch.Tensor.sub_)
        weight = values.to(torch.float32)
    elif data.device.type == "cpu" and data.dtype == FP8_WEIGHT_DTYPE:
        weight = e4m3_as_half(data).to(torch.float32)
        scale = scale * E4M3_AS_HALF_FACTOR
    else:
        # Widen, then scale in place: on a CPU this measured faster than one multiply that
        # widens as it goes (torch's mixed-dtype path is not vectorised).
        weight = data.to(torch.float32)
        if zero_point is not None:  # asymmetric 8-bit codes: up to 255 from their zero point
            _per_group(weight, zero_point.to(torch.float32), group_size, torch.Tensor.sub_)
    _per_group(weight, scale, group_size, torch.Tensor.mul_)
    return weight.to(dtype)


def _per_group(weight: torch.Tensor, per_group: torch.Tensor, group_size: int,
               operation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """`operation` (an in-place op) of each [row, group] value onto its group of the weight's
    columns. The values broadcast over a view of the weight: never a second weight-sized
    tensor."""
    rows, cols = weight.shape
    if per_group.shape[1] == 1:
        operation(weight, per_group)
        return
    full, rest = divmod(cols, group_size)
    operation(weight[:, :full * group_size].view(rows, full, group_size),
              per_group[:, :full, None])
    if rest:
        operation(weight[:, full * group_size:], per_group[:, full:])


def split_nibbles(octets: torch.Tensor) -> torch.Tensor:
    """Bytes of two 4-bit fields, the first in the low nibble, as one uint8 per field:
    [rows, n] -> [rows, 2n]."""
    rows, count = octets.shape
    # Each byte b widened to 16 bits as (b & 0xF) | (b >> 4) << 8: read as two little-endian
    # bytes, the low nibble first. Four int16 passes: 3x faster on a CPU than stacking the two
    # nibbles (a strided uint8 write), which matters because CPU matmuls unpack every call.
    wide = octets.contiguous().view(torch.uint8).to(torch.int16)
    fields = torch.bitwise_left_shift(wide, 4).bitwise_or_(wide).bitwise_and_(0x0F0F)
    return fields.view(torch.uint8).view(rows, 2 * count)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (0..15, an even number of columns) two per byte, the even column's in the
    low nibble: [rows, 2n] -> uint8 [rows, n]."""
    if codes.shape[1] % 2:
        raise ValueError(f"packing 4-bit codes needs an even number of columns, got "
                         f"{codes.shape[1]}")
    pairs = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return (pairs[..., 0] | pairs[..., 1] << 4).contiguous()


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The `bits`-bit fields (4 or 8) of int32 words, the first in the lowest bits, as uint8:
    [rows, words] -> [rows, words * 32 / bits]. The way GPTQ, AWQ and compressed-tensors all
    pack integer weights (each then orders its fields its own way)."""
    if bits not in (4, 8):
        raise ValueError(f"unpacking {bits}-bit fields is not supported (4 or 8)")
    rows = words.shape[0]
    # Flat first: a [n, 1] view counts as contiguous with any stride, which a byte view refuses.
    octets = words.contiguous().reshape(-1).view(torch.uint8).view(rows, -1)  # little-endian
    return octets if bits == 8 else split_nibbles(octets)


def quantize_fp8(weight: torch.Tensor, block_size: tuple[int, int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, `weight_scale_inv`) of a 2-D weight in a checkpoint's layout: one scale per
    [block_rows, block_cols] tile (tiles at the edges may be smaller), or with `block_size` None
    one for the whole tensor. Each tile's largest magnitude maps to FP8's 448."""
    rows, cols = weight.shape
    block_rows, block_cols = block_size if block_size is not None else (rows, cols)
    w = weight.detach().to(torch.float32)
    grid_rows, grid_cols = math.ceil(rows / block_rows), math.ceil(cols / block_cols)
    padded = torch.zeros(grid_rows * block_rows, grid_cols * block_cols, dtype=torch.float32,
                         device=w.device)
    padded[:rows, :cols] = w
    tiles = padded.view(grid_rows, block_rows, grid_cols, block_cols)
    amax = tiles.abs().amax(dim=(1, 3))
    # An all-zero tile keeps scale 1 (its values quantize to zeros either way).
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    data = quantized.view(padded.shape)[:rows, :cols].to(FP8_WEIGHT_DTYPE)
    return data.contiguous(), scale
