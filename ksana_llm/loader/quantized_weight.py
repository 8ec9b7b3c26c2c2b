"""A quantized weight in memory (`QuantizedWeight`): one byte per number (float8_e4m3fn, or
int8 codes minus zero points) and one float32 scale per row and input group (the row scales of
a checkpoint's block are the block's scale repeated), so a tensor-parallel rank can take any
rows and group-aligned columns of it. The checkpoint formats (`fp8_weights`, `gptq_awq`) make
them; the modules that keep quantized weights (the projections, `MergedLinear` and
`RowParallelLinear`, and the MoE experts, `FusedExperts`) take them as they are, everything
else gets them dequantized (`dense`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ksana_llm.loader.weight_quant import (INT_WEIGHT_DTYPE, QUANTIZED_WEIGHT_DTYPES,
                                           dequantize_weight, quantize_fp8)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, cols] weight as 8-bit values (FP8, or int8 integer codes) and float32 scales,
    `scale[r, g]` multiplying `data[r, g * group_size:(g + 1) * group_size]` (the last group
    may be shorter).

    `input_order` (GPTQ's activation order): column j of `data` belongs to input
    `input_order[j]`, so the weight multiplies `x[..., input_order]`; the columns are stored in
    the order that puts each scale group together."""

    data: torch.Tensor
    scale: torch.Tensor
    group_size: int
    input_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.data.dtype not in QUANTIZED_WEIGHT_DTYPES:
            raise ValueError(f"quantized weight values: {self.data.dtype}, expected one of "
                             f"{QUANTIZED_WEIGHT_DTYPES}")
        rows, cols = self.data.shape
        if self.scale.shape != (rows, math.ceil(cols / self.group_size)):
            raise ValueError(f"quantized weight scales: shape {tuple(self.scale.shape)} does "
                             f"not cover a [{rows}, {cols}] weight in groups of {self.group_size}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def rows(self, start: int, count: int) -> QuantizedWeight:
        return QuantizedWeight(self.data[start:start + count], self.scale[start:start + count],
                               self.group_size, self.input_order)

    def split_rows(self, sizes: list[int]) -> list[QuantizedWeight]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.rows(start, size) for start, size in zip(starts, sizes)]

    def columns(self, start: int, count: int) -> QuantizedWeight | torch.Tensor:
        """Input columns [start, start + count): whole groups only, unless one scale covers the
        row (per-row or per-tensor scales hold for any columns). In activation order a part of
        the inputs is no set of whole groups: it comes dequantized (float32)."""
        cols = self.data.shape[1]
        if self.input_order is not None:
            return self if (start, count) == (0, cols) \
                else self.dequantize()[:, start:start + count]
        if self.scale.shape[1] == 1:
            return QuantizedWeight(self.data[:, start:start + count], self.scale, max(count, 1))
        end = start + count
        if start % self.group_size or (end % self.group_size and end != cols):
            raise ValueError(f"columns [{start}, {end}) of a quantized weight split its scale "
                             f"blocks of {self.group_size} columns: choose a "
                             "tensor_parallel_size that splits the input at block boundaries")
        first = start // self.group_size
        return QuantizedWeight(self.data[:, start:end],
                               self.scale[:, first:math.ceil(end / self.group_size)],
                               self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [rows, cols] weight, columns in input order."""
        return in_input_order(dequantize_weight(self.data, self.scale, self.group_size, dtype),
                              self.input_order)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.data.to(device), self.scale.to(device), self.group_size,
                               None if self.input_order is None else self.input_order.to(device))


def quantize_fp8_rows(weight: torch.Tensor) -> QuantizedWeight:
    """A weight quantized with one scale per output row (online quantization: per-row scales
    follow each output channel's range, so they lose less than one scale per tensor)."""
    data, scale = quantize_fp8(weight, (1, weight.shape[1]))
    return QuantizedWeight(data, scale, weight.shape[1])


def integer_weight(values: torch.Tensor, scale: torch.Tensor, group_size: int,
                   input_order: torch.Tensor | None = None) -> QuantizedWeight | torch.Tensor:
    """Integer codes minus their zero points ([rows, cols], columns in `input_order` when
    given) with float32 group scales ([rows, groups]): held exactly as int8 when every value
    fits (4-bit codes always do, and symmetric 8-bit ones), else dequantized to float32
    (asymmetric 8-bit codes lie up to 255 from their zero point)."""
    if values.numel() == 0 or (int(values.min()) >= -128 and int(values.max()) <= 127):
        return QuantizedWeight(values.to(INT_WEIGHT_DTYPE), scale.contiguous(), group_size,
                               input_order)
    return in_input_order(dequantize_weight(values, scale, group_size), input_order)


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
