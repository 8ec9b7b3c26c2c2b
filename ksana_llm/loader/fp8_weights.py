"""FP8 weights: the checkpoint format, how its tensors pair up, and quantizing weights to it.

An FP8 checkpoint (`quantization_config.quant_method: "fp8"`: DeepSeek V3/R1, Qwen3-*-FP8, and
what transformers' `FineGrainedFP8Config` writes; or llm-compressor's `"compressed-tensors"` in
its "float-quantized" format, with the scales in `weight_scale`) stores each quantized linear
weight as `<name>.weight` in float8_e4m3fn plus `<name>.weight_scale_inv`, float32 scales that
*multiply* the FP8 values back (the name says "inverse" of the scale the weight was divided by):
- one scale per `weight_block_size` tile ([128, 128] in the released models), shape
  [ceil(rows / 128), ceil(cols / 128)];
- or, without a block size, one scale for the whole tensor (vLLM's per-tensor checkpoints call
  it `weight_scale`; a per-row [rows] / [rows, 1] one is read too).
llm-compressor's int4 checkpoints (compressed-tensors, "pack-quantized") load through the same
record: their codes minus zero points are integers E4M3 holds exactly (see `int4_as_fp8`).
Static activation scales (`input_scale`) are dropped: the engine multiplies FP8 weights with
activations in the model's dtype (W8A16), which is more exact than quantizing activations too.

In memory a quantized weight is an `Fp8Weight`: the FP8 values and one scale per row and input
group (the row scales of a block are the block's scale repeated), so a tensor-parallel rank can
take any rows and group-aligned columns of it. Modules that keep FP8 weights (the projections,
`MergedLinear` and `RowParallelLinear`, and the MoE experts, `FusedExperts`) take it as it is;
everything else gets it dequantized.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ksana_llm.loader.weight_quant import (FP8_WEIGHT_DTYPE, dequantize_fp8, quantize_fp8,
                                           unpack_words)

# Checkpoint suffixes of a weight's scale (both multiply the FP8 values back).
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
# What the engine can do with weights: keep a checkpoint's FP8 weights (None), or quantize a
# full-precision checkpoint's projections to FP8 as they load ("fp8"; KsanaLLM's
# `quantization_config.weight.quant_method: fp8_e4m3`, vLLM's `--quantization fp8`).
WEIGHT_QUANTIZATIONS = ("fp8",)


@dataclass(frozen=True)
class Fp8Weight:
    """A [rows, cols] weight as FP8 values and float32 scales, `scale[r, g]` multiplying
    `data[r, g * group_size:(g + 1) * group_size]` (the last group may be shorter)."""

    data: torch.Tensor
    scale: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        rows, cols = self.data.shape
        if self.scale.shape != (rows, math.ceil(cols / self.group_size)):
            raise ValueError(f"FP8 weight scales: shape {tuple(self.scale.shape)} does not cover "
                             f"a [{rows}, {cols}] weight in groups of {self.group_size}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def rows(self, start: int, count: int) -> Fp8Weight:
        return Fp8Weight(self.data[start:start + count], self.scale[start:start + count],
                         self.group_size)

    def split_rows(self, sizes: list[int]) -> list[Fp8Weight]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.rows(start, size) for start, size in zip(starts, sizes)]

    def columns(self, start: int, count: int) -> Fp8Weight:
        """Input columns [start, start + count): whole groups only, unless one scale covers the
        row (per-row or per-tensor scales hold for any columns)."""
        cols = self.data.shape[1]
        if self.scale.shape[1] == 1:
            return Fp8Weight(self.data[:, start:start + count], self.scale, max(count, 1))
        end = start + count
        if start % self.group_size or (end % self.group_size and end != cols):
            raise ValueError(f"columns [{start}, {end}) of an FP8 weight split its scale blocks "
                             f"of {self.group_size} columns: choose a tensor_parallel_size that "
                             "splits the input at block boundaries")
        first = start // self.group_size
        return Fp8Weight(self.data[:, start:end],
                         self.scale[:, first:math.ceil(end / self.group_size)], self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.data, self.scale, self.group_size, dtype)

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scale.to(device), self.group_size)


def quantize_fp8_rows(weight: torch.Tensor) -> Fp8Weight:
    """A weight quantized with one scale per output row (online quantization: per-row scales
    follow each output channel's range, so they lose less than one scale per tensor)."""
    data, scale = quantize_fp8(weight, (1, weight.shape[1]))
    return Fp8Weight(data, scale, weight.shape[1])


def fp8_weight_from_checkpoint(data: torch.Tensor, scale: torch.Tensor,
                               block_size: tuple[int, int] | None, name: str) -> Fp8Weight:
    """A checkpoint's FP8 weight and its scale tensor as an `Fp8Weight` (block rows expanded
    to per-row scales)."""
    if data.dim() != 2:
        raise ValueError(f"{name}: FP8 weights must be 2-D, got shape {tuple(data.shape)}")
    rows, cols = data.shape
    scale = scale.to(torch.float32)
    if scale.numel() == 1:  # per tensor
        return Fp8Weight(data, scale.reshape(1, 1).expand(rows, 1).contiguous(), cols)
    if scale.dim() == 1 or (scale.dim() == 2 and scale.shape[1] == 1 and block_size is None):
        if scale.shape[0] != rows:
            raise ValueError(f"{name}: {scale.shape[0]} per-row scales for {rows} rows")
        return Fp8Weight(data, scale.reshape(rows, 1).contiguous(), cols)
    if block_size is None:
        raise ValueError(f"{name}: scales of shape {tuple(scale.shape)} need "
                         "quantization_config.weight_block_size")
    block_rows, block_cols = block_size
    expected = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}: scales of shape {tuple(scale.shape)}, expected {expected} "
                         f"for a [{rows}, {cols}] weight in {block_rows}x{block_cols} blocks")
    per_row = scale.repeat_interleave(block_rows, dim=0)[:rows].contiguous()
    return Fp8Weight(data, per_row, block_cols)


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """What `quantization_config` says of a quantized checkpoint: FP8 weights (with
    `block_size` scale tiles, or per tensor / channel), or int4 weights packed in int32
    (`int4`, compressed-tensors' pack-quantized; `symmetric` False: with zero points)."""

    block_size: tuple[int, int] | None
    int4: bool = False
    symmetric: bool = True

    @classmethod
    def from_quantization(cls, quantization: dict[str, Any]) -> QuantizedCheckpoint:
        """The format of an FP8 or compressed-tensors checkpoint from its `quantization_config`.
        Another quantization method is refused by name: its tensors would not load."""
        method = quantization.get("quant_method")
        if method == "compressed-tensors":
            return cls._from_compressed_tensors(quantization)
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported: "
                             "ksana-llm loads full-precision checkpoints, FP8 ones "
                             "(quant_method 'fp8', or 'compressed-tensors' float-quantized), "
                             "int4 ones in compressed-tensors' pack-quantized format, and "
                             "GPTQ and AWQ ones; dequantize the checkpoint first")
        fmt = quantization.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (only e4m3)")
        return cls(_block_size(quantization.get("weight_block_size"),
                               "quantization_config.weight_block_size"))

    @classmethod
    def _from_compressed_tensors(cls, quantization: dict) -> QuantizedCheckpoint:
        """llm-compressor's checkpoints (vLLM's `compressed-tensors` method): FP8 weights
        ("float-quantized", per-tensor, per-channel or block scales in `weight_scale`), or int4
        weights ("pack-quantized": `weight_packed`, group or channel `weight_scale`, and
        `weight_zero_point` when asymmetric)."""
        kinds: set[QuantizedCheckpoint] = set()
        for name, group in (quantization.get("config_groups") or {}).items():
            where = f"quantization_config.config_groups.{name}"
            fmt = group.get("format") or quantization.get("format")
            weights = group.get("weights") or {}
            kind, bits, strategy = weights.get("type"), weights.get("num_bits"), \
                weights.get("strategy")
            if fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8:
                if strategy not in ("tensor", "channel", "block") \
                        or not weights.get("symmetric", True):
                    raise ValueError(f"{where}.weights: strategy {strategy!r} is not supported "
                                     "(FP8 weights take tensor, channel or block scales)")
                kinds.add(cls(_block_size(weights.get("block_structure"),
                                          f"{where}.weights.block_structure")
                              if strategy == "block" else None))
            elif fmt == "pack-quantized" and kind == "int" and bits == 4:
                # actorder "weight" (alias "static") only changed how GPTQ calibrated: the
                # format is the plain one. "group" (alias "dynamic") stores a g_idx.
                if strategy not in ("group", "channel") \
                        or weights.get("actorder") not in (None, "weight", "static"):
                    raise ValueError(f"{where}.weights: int4 with strategy {strategy!r} and "
                                     f"actorder {weights.get('actorder')!r} is not supported "
                                     "(group or channel scales; activation order 'weight' / "
                                     "'static' or none)")
                kinds.add(cls(None, int4=True, symmetric=bool(weights.get("symmetric", True))))
            else:
                raise ValueError(f"{where}: compressed-tensors format {fmt!r} with "
                                 f"{bits}-bit {kind} weights is not supported: FP8 weights "
                                 "(float-quantized) and int4 weights (pack-quantized) are")
        if len(kinds) > 1:
            raise ValueError("quantization_config.config_groups: groups of different weight "
                             f"formats ({sorted(map(str, kinds))}) are not supported")
        return kinds.pop() if kinds else cls(None)


def _block_size(block: Any, where: str) -> tuple[int, int] | None:
    if block is None:
        return None
    if len(block) != 2 or any(int(b) < 1 for b in block):
        raise ValueError(f"{where} must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def paired_weights(weights: Iterable[tuple[str, torch.Tensor]], fmt: QuantizedCheckpoint
                   ) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """The checkpoint's tensors with each quantized weight's parts joined into one `Fp8Weight`
    under the weight's name (`<name>.weight`); see `_paired_fp8` and `_paired_int4`."""
    return _paired_int4(weights, fmt) if fmt.int4 else _paired_fp8(weights, fmt)


def _paired_fp8(weights: Iterable[tuple[str, torch.Tensor]], fmt: QuantizedCheckpoint
                ) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """Each FP8 weight and its scale joined; activation scales dropped; everything else as it
    is. Either half of a pair may come first, so the earlier one waits (sorted shards put them
    side by side)."""
    waiting_data: dict[str, torch.Tensor] = {}
    waiting_scale: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        base, _, leaf = name.rpartition(".")
        # Activation scales (we do not quantize activations) and compressed-tensors' KV cache
        # scales (ours come from kv_cache_scales.json) have no place here.
        if leaf in ("input_scale", "activation_scale", "k_scale", "v_scale", "q_scale"):
            continue
        if leaf in SCALE_SUFFIXES:
            if base in waiting_data:
                yield f"{base}.weight", fp8_weight_from_checkpoint(
                    waiting_data.pop(base), tensor, fmt.block_size, f"{base}.weight")
            else:
                waiting_scale[base] = tensor
        elif leaf == "weight" and tensor.dtype == FP8_WEIGHT_DTYPE:
            if base in waiting_scale:
                yield name, fp8_weight_from_checkpoint(tensor, waiting_scale.pop(base),
                                                       fmt.block_size, name)
            else:
                waiting_data[base] = tensor
        else:
            yield name, tensor
    if waiting_data:
        raise ValueError(f"FP8 weights without a weight_scale_inv: {sorted(waiting_data)[:5]}")
    if waiting_scale:
        raise ValueError(f"weight scales without an FP8 weight: {sorted(waiting_scale)[:5]}")


# compressed-tensors' names for the parts of a packed int4 weight.
INT4_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def _paired_int4(weights: Iterable[tuple[str, torch.Tensor]], fmt: QuantizedCheckpoint
                 ) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """Each packed int4 weight's parts joined, as soon as all have come, into an `Fp8Weight`
    holding the same numbers (see `int4_as_fp8`); everything else as it is."""
    needed = {"weight_packed", "weight_scale", "weight_shape"}
    if not fmt.symmetric:
        needed.add("weight_zero_point")
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, leaf = name.rpartition(".")
        if leaf not in INT4_PARTS:
            if leaf == "weight_g_idx":
                raise ValueError(f"{name}: int4 weights with activation order (g_idx) are not "
                                 "supported")
            yield name, tensor
            continue
        parts = waiting.setdefault(base, {})
        parts[leaf] = tensor
        if needed <= parts.keys():
            del waiting[base]
            yield f"{base}.weight", int4_as_fp8(parts, f"{base}.weight")
    if waiting:
        incomplete = {base: sorted(parts) for base, parts in list(waiting.items())[:5]}
        raise ValueError(f"int4 weights missing parts (have {incomplete}; each needs "
                         f"{sorted(needed)})")


def unpack_int4(packed: torch.Tensor, count: int) -> torch.Tensor:
    """int8 values in [-8, 7] from int32 words holding eight 4-bit values each, the first in the
    lowest bits, stored with +8 (compressed-tensors' `pack_to_int32` layout): [rows, count]."""
    return unpack_words(packed, 4)[:, :count].to(torch.int8) - 8


def int4_as_fp8(parts: dict[str, torch.Tensor], name: str) -> Fp8Weight:
    """A packed int4 weight as an `Fp8Weight` with the same numbers: the codes minus their zero
    points are integers in [-15, 15], which E4M3 holds exactly, and the group scales become the
    FP8 group scales. One byte per weight in memory instead of half a byte, but every FP8 path
    (tensor parallel slicing, MoE experts, the Triton matmul) serves it unchanged."""
    rows, cols = (int(v) for v in parts["weight_shape"].tolist())
    scale = parts["weight_scale"].to(torch.float32)
    if scale.dim() != 2 or scale.shape[0] != rows:
        raise ValueError(f"{name}: int4 scales of shape {tuple(scale.shape)} for a "
                         f"[{rows}, {cols}] weight")
    groups = scale.shape[1]
    group_size = math.ceil(cols / groups)
    if math.ceil(cols / group_size) != groups:
        raise ValueError(f"{name}: {groups} scale groups do not divide {cols} columns")
    values = unpack_int4(parts["weight_packed"], cols).to(torch.int16)
    if values.shape != (rows, cols):
        raise ValueError(f"{name}: packed int4 weight of shape "
                         f"{tuple(parts['weight_packed'].shape)} does not hold [{rows}, {cols}]")
    zero = parts.get("weight_zero_point")
    if zero is not None:  # packed along the rows: [ceil(rows / 8), groups] words
        zero = unpack_int4(zero.t(), rows).t().to(torch.int16)
        if zero.shape != (rows, groups):
            raise ValueError(f"{name}: int4 zero points of shape {tuple(zero.shape)}, "
                             f"expected ({rows}, {groups})")
        values = values - zero.repeat_interleave(group_size, dim=1)[:, :cols]
    return Fp8Weight(values.to(FP8_WEIGHT_DTYPE), scale.contiguous(), group_size)


def dense(tensor: torch.Tensor | Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A checkpoint tensor as plain values, for a module that keeps no FP8 weights."""
    return tensor.dequantize(dtype) if isinstance(tensor, Fp8Weight) else tensor
