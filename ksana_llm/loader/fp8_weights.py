"""Quantized weights held at one byte per number: the FP8 checkpoint format and
compressed-tensors' integer formats, how their tensors pair up, and quantizing weights to FP8.

An FP8 checkpoint (`quantization_config.quant_method: "fp8"`: DeepSeek V3/R1, Qwen3-*-FP8, and
what transformers' `FineGrainedFP8Config` writes; or llm-compressor's `"compressed-tensors"` in
its "float-quantized" format, with the scales in `weight_scale`) stores each quantized linear
weight as `<name>.weight` in float8_e4m3fn plus `<name>.weight_scale_inv`, float32 scales that
*multiply* the FP8 values back (the name says "inverse" of the scale the weight was divided by):
- one scale per `weight_block_size` tile ([128, 128] in the released models), shape
  [ceil(rows / 128), ceil(cols / 128)];
- or, without a block size, one scale for the whole tensor (vLLM's per-tensor checkpoints call
  it `weight_scale`; a per-row [rows] / [rows, 1] one is read too).
llm-compressor's integer checkpoints load through the same record with int8 values: W4A16 /
W8A16 ("pack-quantized": 4- or 8-bit codes packed in int32 `weight_packed`, see
`packed_int_weight`) and W8A8 ("int-quantized": int8 `weight` beside `weight_scale`).
W8A8's dynamic per-token int8 activations (the presets') are done as the checkpoint asks (the
weights carry `int8_activations`; see `layers.int8_activations`). Other activation schemes are
not: static activation scales (`input_scale`) are dropped and FP8 ones ignored, the engine
multiplying the weights with activations in the model's dtype (more exact, not what the
checkpoint was evaluated with), which it logs.

Each checkpoint weight becomes a `QuantizedWeight` (see `loader.quantized_weight`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from ksana_llm.loader.quantized_weight import QuantizedWeight, int4_weight, int8_weight
from ksana_llm.loader.weight_quant import QUANTIZED_WEIGHT_DTYPES, unpack_words

logger = logging.getLogger(__name__)

# Checkpoint suffixes of a weight's scale (both multiply the FP8 values back).
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
# What the engine can do with weights: keep a checkpoint's (None), or quantize a
# full-precision checkpoint's projections per row as they load: to FP8 ("fp8"; KsanaLLM's
# `quantization_config.weight.quant_method: fp8_e4m3`, vLLM's `--quantization fp8`), or to int8
# with their inputs int8 per token ("w8a8_int8", SGLang's name for int8 W8A8; the numbers
# llm-compressor's W8A8 preset writes when it rounds to nearest).
WEIGHT_QUANTIZATIONS = ("fp8", "w8a8_int8")


def quantized_weight_from_checkpoint(data: torch.Tensor, scale: torch.Tensor,
                                     block_size: tuple[int, int] | None, name: str
                                     ) -> QuantizedWeight:
    """A checkpoint's FP8 (or int8) weight and its scale tensor as a `QuantizedWeight` (block
    rows expanded to per-row scales)."""
    if data.dim() != 2:
        raise ValueError(f"{name}: quantized weights must be 2-D, got shape {tuple(data.shape)}")
    rows, cols = data.shape
    scale = scale.to(torch.float32)
    if scale.numel() == 1:  # per tensor
        return QuantizedWeight(data, scale.reshape(1, 1).expand(rows, 1).contiguous(), cols)
    if scale.dim() == 1 or (scale.dim() == 2 and scale.shape[1] == 1 and block_size is None):
        if scale.shape[0] != rows:
            raise ValueError(f"{name}: {scale.shape[0]} per-row scales for {rows} rows")
        return QuantizedWeight(data, scale.reshape(rows, 1).contiguous(), cols)
    if block_size is None:
        raise ValueError(f"{name}: scales of shape {tuple(scale.shape)} need "
                         "quantization_config.weight_block_size")
    block_rows, block_cols = block_size
    expected = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}: scales of shape {tuple(scale.shape)}, expected {expected} "
                         f"for a [{rows}, {cols}] weight in {block_rows}x{block_cols} blocks")
    per_row = scale.repeat_interleave(block_rows, dim=0)[:rows].contiguous()
    return QuantizedWeight(data, per_row, block_cols)


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """What `quantization_config` says of a quantized checkpoint: one byte per weight (FP8, or
    compressed-tensors' int8 "int-quantized"), with `block_size` scale tiles or per tensor /
    channel; or integer codes packed in int32 words (`packed_bits` 4 or 8, compressed-tensors'
    "pack-quantized"; `symmetric` False: with zero points). `int8_activations`: the weights'
    inputs are quantized to int8 per token (W8A8)."""

    block_size: tuple[int, int] | None
    packed_bits: int = 0  # 0: the values are stored one per byte, not packed
    symmetric: bool = True
    int8_activations: bool = False

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
                             "int4 / int8 ones in compressed-tensors' pack-quantized and "
                             "int-quantized formats, and GPTQ and AWQ ones; dequantize the "
                             "checkpoint first")
        fmt = quantization.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (only e4m3)")
        return cls(_block_size(quantization.get("weight_block_size"),
                               "quantization_config.weight_block_size"))

    @classmethod
    def _from_compressed_tensors(cls, quantization: dict) -> QuantizedCheckpoint:
        """llm-compressor's checkpoints (vLLM's `compressed-tensors` method): FP8 weights
        ("float-quantized", per-tensor, per-channel or block scales in `weight_scale`); int4 /
        int8 weights ("pack-quantized": `weight_packed`, group or channel `weight_scale`, and
        `weight_zero_point` when asymmetric); or symmetric int8 weights ("int-quantized", the
        W8A8 presets: an int8 `weight`, tensor, channel or group scales, with their dynamic
        per-token int8 activations). Other activation quantization is not done (see the
        module's doc)."""
        kinds: set[QuantizedCheckpoint] = set()
        for name, group in (quantization.get("config_groups") or {}).items():
            where = f"quantization_config.config_groups.{name}"
            fmt = group.get("format") or quantization.get("format")
            weights = group.get("weights") or {}
            kind, bits, strategy = weights.get("type"), weights.get("num_bits"), \
                weights.get("strategy")
            int8_activations = fmt == "int-quantized" \
                and _dynamic_int8_per_token(group.get("input_activations"))
            if group.get("input_activations") and not int8_activations:
                logger.info("%s: activations stay in the model's dtype (ksana-llm quantizes "
                            "them only as dynamic symmetric int8 per token, W8A8's; the "
                            "weights load as the checkpoint holds them)", where)
            if fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8:
                if strategy not in ("tensor", "channel", "block") \
                        or not weights.get("symmetric", True):
                    raise ValueError(f"{where}.weights: strategy {strategy!r} is not supported "
                                     "(FP8 weights take tensor, channel or block scales)")
                kinds.add(cls(_block_size(weights.get("block_structure"),
                                          f"{where}.weights.block_structure")
                              if strategy == "block" else None))
            elif fmt == "pack-quantized" and kind == "int" and bits in (4, 8):
                # actorder "weight" (alias "static") only changed how GPTQ calibrated: the
                # format is the plain one. "group" (alias "dynamic") stores a g_idx.
                if strategy not in ("group", "channel") \
                        or weights.get("actorder") not in (None, "weight", "static"):
                    raise ValueError(f"{where}.weights: int{bits} with strategy {strategy!r} "
                                     f"and actorder {weights.get('actorder')!r} is not "
                                     "supported (group or channel scales; activation order "
                                     "'weight' / 'static' or none)")
                kinds.add(cls(None, packed_bits=bits,
                              symmetric=bool(weights.get("symmetric", True))))
            elif fmt == "int-quantized" and kind == "int" and bits == 8:
                if strategy not in ("tensor", "channel", "group") \
                        or not weights.get("symmetric", True):
                    raise ValueError(f"{where}.weights: int8 with strategy {strategy!r} and "
                                     f"symmetric {weights.get('symmetric')!r} is not supported "
                                     "(symmetric, with tensor, channel or group scales)")
                group_size = weights.get("group_size")
                if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
                    raise ValueError(f"{where}.weights.group_size must be a positive integer "
                                     f"with strategy 'group', got {group_size!r}")
                kinds.add(cls((1, group_size) if strategy == "group" else None,
                              int8_activations=int8_activations))
            else:
                raise ValueError(f"{where}: compressed-tensors format {fmt!r} with "
                                 f"{bits}-bit {kind} weights is not supported: FP8 weights "
                                 "(float-quantized), int4 / int8 weights (pack-quantized) and "
                                 "int8 weights (int-quantized) are")
        if len(kinds) > 1:
            raise ValueError("quantization_config.config_groups: groups of different weight "
                             f"formats ({sorted(map(str, kinds))}) are not supported")
        return kinds.pop() if kinds else cls(None)


def _dynamic_int8_per_token(activations: dict | None) -> bool:
    """Whether compressed-tensors' `input_activations` are W8A8's: int8, symmetric, scaled per
    token on the fly."""
    return bool(activations) and activations.get("type") == "int" \
        and activations.get("num_bits") == 8 and activations.get("symmetric", True) is True \
        and activations.get("dynamic") is True and activations.get("strategy") == "token"


def _block_size(block: Any, where: str) -> tuple[int, int] | None:
    if block is None:
        return None
    if len(block) != 2 or any(int(b) < 1 for b in block):
        raise ValueError(f"{where} must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def paired_weights(weights: Iterable[tuple[str, torch.Tensor]], fmt: QuantizedCheckpoint
                   ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each quantized weight's parts joined into one
    `QuantizedWeight` under the weight's name (`<name>.weight`); see `_paired_bytes` and
    `_paired_packed`."""
    return _paired_packed(weights, fmt) if fmt.packed_bits else _paired_bytes(weights, fmt)


def _paired_bytes(weights: Iterable[tuple[str, torch.Tensor]], fmt: QuantizedCheckpoint
                  ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Each FP8 / int8 weight and its scale joined; activation scales dropped; everything else
    as it is. Either half of a pair may come first, so the earlier one waits (sorted shards put
    them side by side)."""
    waiting_data: dict[str, torch.Tensor] = {}
    waiting_scale: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        base, _, leaf = name.rpartition(".")
        # Static activation scales (activations are quantized only dynamically) and
        # compressed-tensors' KV cache scales (ours come from kv_cache_scales.json) have no
        # place here.
        if leaf in ACTIVATION_QUANTIZATION_PARTS:
            continue
        if leaf in SCALE_SUFFIXES:
            if base in waiting_data:
                yield f"{base}.weight", _with_activations(quantized_weight_from_checkpoint(
                    waiting_data.pop(base), tensor, fmt.block_size, f"{base}.weight"), fmt)
            else:
                waiting_scale[base] = tensor
        elif leaf == "weight" and tensor.dtype in QUANTIZED_WEIGHT_DTYPES:
            if base in waiting_scale:
                yield name, _with_activations(quantized_weight_from_checkpoint(
                    tensor, waiting_scale.pop(base), fmt.block_size, name), fmt)
            else:
                waiting_data[base] = tensor
        else:
            yield name, tensor
    if waiting_data:
        raise ValueError(f"quantized weights without a weight_scale_inv / weight_scale: "
                         f"{sorted(waiting_data)[:5]}")
    if waiting_scale:
        raise ValueError(f"weight scales without a quantized weight: {sorted(waiting_scale)[:5]}")


def _with_activations(weight: QuantizedWeight, fmt: QuantizedCheckpoint) -> QuantizedWeight:
    return replace(weight, int8_activations=True) if fmt.int8_activations else weight


# Checkpoint leaves of activation (and KV cache) quantization: dynamic int8 activations need
# none, static scales and KV-cache scales are not used.
ACTIVATION_QUANTIZATION_PARTS = ("input_scale", "input_zero_point", "activation_scale",
                                 "k_scale", "v_scale", "q_scale")
# compressed-tensors' names for the parts of a packed integer weight.
PACKED_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def _paired_packed(weights: Iterable[tuple[str, torch.Tensor]], fmt: QuantizedCheckpoint
                   ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Each packed integer weight's parts joined, as soon as all have come, into one weight
    (see `packed_int_weight`); activation scales dropped; everything else as it is."""
    needed = {"weight_packed", "weight_scale", "weight_shape"}
    if not fmt.symmetric:
        needed.add("weight_zero_point")
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, leaf = name.rpartition(".")
        if leaf in ACTIVATION_QUANTIZATION_PARTS:
            continue
        if leaf not in PACKED_PARTS:
            if leaf == "weight_g_idx":
                raise ValueError(f"{name}: integer weights with activation order (g_idx) are "
                                 "not supported")
            yield name, tensor
            continue
        parts = waiting.setdefault(base, {})
        parts[leaf] = tensor
        if needed <= parts.keys():
            del waiting[base]
            yield f"{base}.weight", packed_int_weight(parts, fmt.packed_bits, f"{base}.weight")
    if waiting:
        incomplete = {base: sorted(parts) for base, parts in list(waiting.items())[:5]}
        raise ValueError(f"int{fmt.packed_bits} weights missing parts (have {incomplete}; each "
                         f"needs {sorted(needed)})")


def unpack_ints(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int16 values in [-2^(bits-1), 2^(bits-1)) from int32 words of 4- or 8-bit fields, the
    first in the lowest bits, each stored plus 2^(bits-1) (compressed-tensors'
    `pack_to_int32` layout): [rows, count]."""
    return unpack_words(packed, bits)[:, :count].to(torch.int16) - (1 << (bits - 1))


def packed_int_weight(parts: dict[str, torch.Tensor], bits: int, name: str
                      ) -> QuantizedWeight | torch.Tensor:
    """A packed int4 / int8 weight with the same numbers and the group scales: the stored codes
    (0..15 / 0..255) with their zero points (the middle, 8 / 128, for symmetric ones), held by
    `int4_weight` / `int8_weight`."""
    rows, cols = (int(v) for v in parts["weight_shape"].tolist())
    scale = parts["weight_scale"].to(torch.float32)
    if scale.dim() != 2 or scale.shape[0] != rows:
        raise ValueError(f"{name}: int{bits} scales of shape {tuple(scale.shape)} for a "
                         f"[{rows}, {cols}] weight")
    groups = scale.shape[1]
    group_size = math.ceil(cols / groups)
    if math.ceil(cols / group_size) != groups:
        raise ValueError(f"{name}: {groups} scale groups do not divide {cols} columns")
    values = unpack_ints(parts["weight_packed"], bits, cols)
    if values.shape != (rows, cols):
        raise ValueError(f"{name}: packed int{bits} weight of shape "
                         f"{tuple(parts['weight_packed'].shape)} does not hold [{rows}, {cols}]")
    zero = parts.get("weight_zero_point")
    if zero is not None:  # packed along the rows: [ceil(rows * bits / 32), groups] words
        zero = unpack_ints(zero.t(), bits, rows).t()
        if zero.shape != (rows, groups):
            raise ValueError(f"{name}: int{bits} zero points of shape {tuple(zero.shape)}, "
                             f"expected ({rows}, {groups})")
    middle = 1 << (bits - 1)  # unpack_ints took it off the stored codes and zero points
    zero = torch.full_like(scale, middle, dtype=torch.int16) if zero is None else zero + middle
    make = int4_weight if bits == 4 else int8_weight
    return make(values + middle, zero, scale, group_size)
