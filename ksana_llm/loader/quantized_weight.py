"""A quantized weight in memory (`QuantizedWeight`): one byte per number (float8_e4m3fn, or
int8 codes minus zero points) or half a byte (4-bit codes, with their zero points), and one
scale per row and input group (float32; MXFP4's one E8M0 byte; the row scales of a
checkpoint's block are the block's scale repeated), so a tensor-parallel rank can take any
rows and columns of it (`QuantizedWeight.columns`). The checkpoint formats (`fp8_weights`,
`gptq_awq`, `mxfp4`) make them; the modules that keep quantized weights (the projections,
`MergedLinear` and `RowParallelLinear`, and the MoE experts, `FusedExperts`) take them as they
are, everything else gets them dequantized (`dense`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ksana_llm.loader.weight_quant import (E2M1_VALUES, E8M0_BIAS, E8M0_DTYPE,
                                           INT_WEIGHT_DTYPE, MXFP4_BLOCK, PACKED_INT4_DTYPE,
                                           QUANTIZED_WEIGHT_DTYPES, dequantize_weight,
                                           e2m1_codes, e8m0_scales, pack_nibbles,
                                           quantize_fp8, quantize_int8_rows, quantize_mxfp4,
                                           split_nibbles)


# Packed codes (0..15) minus their zero points must fit int8: the dequantization subtracts them
# at one byte.
PACKED_ZERO_RANGE = (15 - 127, 127)
# The smallest groups a column slice is regrouped into: below it a float32 scale per group
# costs as much memory as the codes, and no quantized kernel takes the groups.
SMALLEST_REGROUP = 16


class QuantizedLayout(NamedTuple):
    """What the rows stored in one quantized weight (a fused projection's parts, an expert
    stack's experts) must share: the values' dtype, the scale groups per row, the group size,
    the zero points' dtype (None without them) and whether the input is quantized to int8 (see
    `QuantizedWeight.int8_activations`)."""

    dtype: torch.dtype
    groups: int
    group_size: int
    zero_dtype: torch.dtype | None
    int8_activations: bool = False
    fp4: bool = False

    @property
    def scale_dtype(self) -> torch.dtype:
        """How the scales are stored: E8M0 bytes for FP4 codes, float32 otherwise."""
        return E8M0_DTYPE if self.fp4 else torch.float32

    @property
    def unit_scale(self) -> int:
        """A scale of 1 in that storage (what a stack's scales start as)."""
        return E8M0_BIAS if self.fp4 else 1

    @classmethod
    def of(cls, data: torch.Tensor, groups: int, group_size: int,
           zero_point: torch.Tensor | None, int8_activations: bool = False,
           fp4: bool = False) -> QuantizedLayout:
        return cls(data.dtype, groups, group_size,
                   None if zero_point is None else zero_point.dtype, int8_activations, fp4)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, cols] weight as 8-bit values (FP8, or int8 integer codes) or packed 4-bit codes,
    and float32 scales (FP4's: E8M0 bytes), `scale[r, g]` multiplying
    `data[r, g * group_size:(g + 1) * group_size]` (the last group may be shorter).

    `zero_point[r, g]` (the shape of `scale`), where present, is subtracted from the group's
    codes before the scale multiplies them. Packed 4-bit codes (`data` uint8 [rows, cols / 2],
    two codes 0..15 a byte, the even column's in the low nibble) always have them (int8); int8
    data has them only for asymmetric 8-bit checkpoints (codes 0..255 held minus 128, zero
    points minus 128 as int16: a GPTQ v1 zero point may read 256) -- otherwise int8 data holds
    its codes minus their zero points already.

    `input_order` (GPTQ's activation order): column j of the weight belongs to input
    `input_order[j]`, so the weight multiplies `x[..., input_order]`; the columns are stored in
    the order that puts each scale group together.

    `int8_activations` (W8A8 checkpoints): the checkpoint quantizes the weight's input to int8,
    one scale per token, before the matmul (see `layers.int8_activations`); a module holding the
    weight does the same.

    `fp4` (MXFP4 checkpoints): the packed codes are e2m1 values (`weight_quant.E2M1_VALUES`),
    not integers; they have no zero points and their scales are powers of two, held as E8M0
    exponent bytes (`weight_quant.e8m0_scales`)."""

    data: torch.Tensor
    scale: torch.Tensor
    group_size: int
    input_order: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    int8_activations: bool = False
    fp4: bool = False

    def __post_init__(self) -> None:
        if self.data.dtype not in QUANTIZED_WEIGHT_DTYPES + (PACKED_INT4_DTYPE,):
            raise ValueError(f"quantized weight values: {self.data.dtype}, expected one of "
                             f"{QUANTIZED_WEIGHT_DTYPES} or packed 4-bit codes (uint8)")
        rows, cols = self.shape
        groups = math.ceil(cols / self.group_size)
        if self.scale.shape != (rows, groups):
            raise ValueError(f"quantized weight scales: shape {tuple(self.scale.shape)} does "
                             f"not cover a [{rows}, {cols}] weight in groups of {self.group_size}")
        if self.fp4:
            if not self.packed or self.zero_point is not None:
                raise ValueError("FP4 codes come packed two a byte (uint8), without zero points")
            if self.scale.dtype != E8M0_DTYPE:
                raise ValueError(f"FP4 scales are E8M0 exponent bytes (uint8), got "
                                 f"{self.scale.dtype}")
            if groups > 1 and self.group_size % 2:
                raise ValueError(f"packed 4-bit groups of {self.group_size} columns split bytes")
        elif self.packed:
            zero = self.zero_point
            if zero is None or zero.shape != self.scale.shape or zero.dtype != INT_WEIGHT_DTYPE:
                raise ValueError("packed 4-bit codes need one int8 zero point per scale, got "
                                 f"{None if zero is None else (tuple(zero.shape), zero.dtype)}")
            if zero.numel() and (int(zero.min()) < PACKED_ZERO_RANGE[0]
                                 or int(zero.max()) > PACKED_ZERO_RANGE[1]):
                raise ValueError(f"packed 4-bit zero points must lie in {PACKED_ZERO_RANGE} "
                                 "(codes minus zero points are taken at one byte)")
            if groups > 1 and self.group_size % 2:
                raise ValueError(f"packed 4-bit groups of {self.group_size} columns split bytes")
        elif self.zero_point is not None and (self.data.dtype != INT_WEIGHT_DTYPE
                                              or self.zero_point.shape != self.scale.shape):
            raise ValueError("zero points belong to integer codes, one per scale: got "
                             f"{tuple(self.zero_point.shape)} for {self.data.dtype} data with "
                             f"scales {tuple(self.scale.shape)}")

    @property
    def layout(self) -> QuantizedLayout:
        return QuantizedLayout.of(self.data, self.scale.shape[1], self.group_size,
                                  self.zero_point, self.int8_activations, self.fp4)

    @property
    def packed(self) -> bool:
        """Two 4-bit codes a byte (see the class doc)."""
        return self.data.dtype == PACKED_INT4_DTYPE

    @property
    def shape(self) -> torch.Size:
        rows, stored = self.data.shape
        return torch.Size((rows, 2 * stored if self.packed else stored))

    def rows(self, start: int, count: int) -> QuantizedWeight:
        zero = None if self.zero_point is None else self.zero_point[start:start + count]
        return replace(self, data=self.data[start:start + count],
                       scale=self.scale[start:start + count], zero_point=zero)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` names, in that order (their codes, scales and zero points)."""
        index = index.to(self.data.device)
        zero = None if self.zero_point is None else self.zero_point.index_select(0, index)
        return replace(self, data=self.data.index_select(0, index),
                       scale=self.scale.index_select(0, index), zero_point=zero)

    def split_rows(self, sizes: list[int]) -> list[QuantizedWeight]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.rows(start, size) for start, size in zip(starts, sizes)]

    def columns(self, start: int, count: int) -> QuantizedWeight | torch.Tensor:
        """Input columns [start, start + count), the same numbers: in the weight's own groups
        where the slice starts on one, else in smaller groups that fit it (`regrouped`: a
        tensor-parallel rank holding part of a scale block) -- dequantized (float32) where
        those would be under `SMALLEST_REGROUP` columns, as in activation order, where a part
        of the inputs is no set of whole groups. Packed codes split at an odd column come as
        int8."""
        cols = self.shape[1]
        if self.input_order is not None:
            return self if (start, count) == (0, cols) \
                else self.dequantize()[:, start:start + count]
        if self.packed and (start % 2 or count % 2):
            return self.unpacked().columns(start, count)
        per_byte = 2 if self.packed else 1
        data = self.data[:, start // per_byte:(start + count) // per_byte]
        if self.scale.shape[1] == 1:  # one scale a row holds for any columns
            return replace(self, data=data, group_size=max(count, 1))
        if start % self.group_size:
            group = math.gcd(self.group_size, start)
            if group < SMALLEST_REGROUP:
                return self.dequantize()[:, start:start + count]
            return self.regrouped(group).columns(start, count)
        # the slice's last group may be shorter, as a weight's last one may
        groups = slice(start // self.group_size, math.ceil((start + count) / self.group_size))
        return replace(self, data=data, scale=self.scale[:, groups],
                       zero_point=None if self.zero_point is None else self.zero_point[:, groups])

    def regrouped(self, group_size: int) -> QuantizedWeight:
        """The same numbers in groups of `group_size` columns (a divisor of the weight's), each
        group's scale and zero point repeated over its parts; packed codes need an even size,
        else they come as int8."""
        if self.group_size % group_size:
            raise ValueError(f"groups of {group_size} columns do not divide the weight's "
                             f"groups of {self.group_size}")
        if self.packed and group_size % 2:
            return self.unpacked().regrouped(group_size)
        parts = self.group_size // group_size
        groups = math.ceil(self.shape[1] / group_size)

        def repeated(per_group: torch.Tensor) -> torch.Tensor:
            return per_group.repeat_interleave(parts, dim=1)[:, :groups].contiguous()

        return replace(self, scale=repeated(self.scale), group_size=group_size,
                       zero_point=None if self.zero_point is None
                       else repeated(self.zero_point))

    def unpacked(self) -> QuantizedWeight:
        """The same numbers as 8-bit integers (codes minus zero points, which lie in
        [-128, 127] for 4-bit codes; FP4 codes as twice their values, under half the scales),
        for code that takes 8-bit data only; 8-bit data as it is."""
        if not self.packed:
            return self
        if self.fp4:
            codes = e2m1_codes(self.data, tuple(2 * v for v in E2M1_VALUES), INT_WEIGHT_DTYPE)
            return replace(self, data=codes, scale=e8m0_scales(self.scale) / 2, fp4=False)
        values = split_nibbles(self.data).to(torch.int16)
        zeros = self.zero_point.to(torch.int16).repeat_interleave(self.group_size, dim=1)
        values = values - zeros[:, :values.shape[1]]
        return replace(self, data=values.to(INT_WEIGHT_DTYPE), zero_point=None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [rows, cols] weight, columns in input order."""
        return in_input_order(dequantize_weight(self.data, self.scale, self.group_size, dtype,
                                                self.zero_point, self.fp4), self.input_order)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return replace(self, data=self.data.to(device), scale=self.scale.to(device),
                       input_order=None if self.input_order is None
                       else self.input_order.to(device),
                       zero_point=None if self.zero_point is None else self.zero_point.to(device))


def quantize_fp8_rows(weight: torch.Tensor) -> QuantizedWeight:
    """A weight quantized with one scale per output row (online quantization: per-row scales
    follow each output channel's range, so they lose less than one scale per tensor)."""
    data, scale = quantize_fp8(weight, (1, weight.shape[1]))
    return QuantizedWeight(data, scale, weight.shape[1])


def quantize_w8a8_rows(weight: torch.Tensor) -> QuantizedWeight:
    """A weight as int8 codes with one scale per row, its input quantized to int8 per token
    too (online W8A8: the numbers llm-compressor's W8A8 preset writes when it rounds to nearest,
    without GPTQ or SmoothQuant)."""
    codes, scale = quantize_int8_rows(weight)
    return QuantizedWeight(codes, scale, weight.shape[1], int8_activations=True)


def quantize_mxfp4_weight(weight: torch.Tensor) -> QuantizedWeight:
    """A weight as MXFP4 (`weight_quant.quantize_mxfp4`): packed e2m1 codes, a power-of-two
    scale (an E8M0 byte) per 32 columns."""
    codes, scale = quantize_mxfp4(weight)
    return QuantizedWeight(codes, scale, MXFP4_BLOCK, fp4=True)


def quantize_on_load(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """A full-precision weight quantized by an online method (see
    `fp8_weights.WEIGHT_QUANTIZATIONS`; "mxfp4": what an MXFP4 expert stack takes dense
    tensors as, `layers.moe_loading`)."""
    if method == "fp8":
        return quantize_fp8_rows(weight)
    if method == "w8a8_int8":
        return quantize_w8a8_rows(weight)
    if method == "mxfp4":
        return quantize_mxfp4_weight(weight)
    raise ValueError(f"unknown online weight quantization {method!r}")


def int8_weight(codes: torch.Tensor, zero_point: torch.Tensor, scale: torch.Tensor,
                group_size: int, input_order: torch.Tensor | None = None) -> QuantizedWeight:
    """8-bit codes ([rows, cols] in 0..255, columns in `input_order` when given) with their
    [rows, groups] zero points and float32 scales: as int8 codes minus their zero point where
    one zero point serves the whole weight (symmetric checkpoints: 128) and the differences fit,
    else (asymmetric ones: codes up to 255 from their zero points) as the codes minus 128 with
    their zero points minus 128 beside them. The choice follows the checkpoint's kind, not
    whether one weight's differences happen to fit, so every weight of a fused projection or an
    expert stack takes the same form (two forms in one would make it dense)."""
    shared_zero = zero_point.numel() == 0 or bool((zero_point == zero_point.flatten()[0]).all())
    if shared_zero:
        zero = int(zero_point.flatten()[0]) if zero_point.numel() else 0
        values = codes.to(torch.int16) - zero
        if values.numel() == 0 or (int(values.min()) >= -128 and int(values.max()) <= 127):
            return QuantizedWeight(values.to(INT_WEIGHT_DTYPE), scale.contiguous(), group_size,
                                   input_order)
    return QuantizedWeight((codes.to(torch.int16) - 128).to(INT_WEIGHT_DTYPE),
                           scale.contiguous(), group_size, input_order,
                           (zero_point.to(torch.int16) - 128).contiguous())


def int4_weight(codes: torch.Tensor, zero_point: torch.Tensor, scale: torch.Tensor,
                group_size: int, input_order: torch.Tensor | None = None) -> QuantizedWeight:
    """4-bit codes ([rows, cols] in 0..15, columns in `input_order` when given) with their
    [rows, groups] zero points and float32 scales, held packed two a byte; as int8 codes
    (`int8_weight`) where packing would split a byte (an odd number of columns, odd groups) or
    the zero points lie too far from the codes to subtract them at one byte."""
    cols = codes.shape[1]
    zeros_fit = zero_point.numel() == 0 or (int(zero_point.min()) >= PACKED_ZERO_RANGE[0]
                                            and int(zero_point.max()) <= PACKED_ZERO_RANGE[1])
    if not cols % 2 and (scale.shape[1] == 1 or not group_size % 2) and zeros_fit:
        return QuantizedWeight(pack_nibbles(codes), scale.contiguous(), group_size, input_order,
                               zero_point.to(INT_WEIGHT_DTYPE).contiguous())
    return int8_weight(codes, zero_point, scale, group_size, input_order)


def in_input_order(weight: torch.Tensor, input_order: torch.Tensor | None) -> torch.Tensor:
    """A weight whose column j belongs to input `input_order[j]`, with its columns put back in
    input order (as it is without an order)."""
    if input_order is None:
        return weight
    unordered = torch.empty_like(weight)
    unordered[:, input_order] = weight
    return unordered


def dense(tensor: torch.Tensor | QuantizedWeight, dtype: torch.dtype = torch.float32
          ) -> torch.Tensor:
    """A checkpoint tensor as plain values, for a module that keeps no FP8 weights."""
    return tensor.dequantize(dtype) if isinstance(tensor, QuantizedWeight) else tensor
