"""GPTQ and AWQ checkpoints: integer codes packed in int32 words, with group scales and zero
points (the Qwen "-GPTQ-Int4" / "-GPTQ-Int8" / "-AWQ" models, what AutoGPTQ, GPTQModel and AutoAWQ
write).

The two pack the same numbers differently. For a linear layer with `in` inputs and `out`
outputs, `bits`-bit codes, groups of `group_size` inputs:
- GPTQ (`quant_method: "gptq"`): `qweight` [in * bits / 32, out], codes packed along the
  inputs (word k holds inputs k * 32/bits ..., the first in the lowest bits); `qzeros`
  [groups, out * bits / 32] packed along the outputs; `scales` [groups, out]; `g_idx` [in], the
  group of each input (not `i // group_size` when the checkpoint was quantized in activation
  order, `desc_act`). The original format ("gptq", checkpoint_format v1) stores each zero point
  minus one, and readers add the one back: weight = scale * (code - (stored zero + 1));
  "gptq_v2" stores it as it is.
- AWQ (`quant_method: "awq"`, version "gemm"): `qweight` [in, out * bits / 32] and `qzeros`
  [groups, out * bits / 32], both packed along the outputs in the interleaved order
  0, 2, 4, 6, 1, 3, 5, 7 (the word's n-th nibble holds output `AWQ_PACK_ORDER[n]`); `scales`
  [groups, out]; groups always `i // group_size`; weight = scale * (code - zero).

A weight becomes a `QuantizedWeight` holding exactly its numbers: 4-bit codes packed two a
byte with their zero points and group scales (`int4_weight`), 8-bit codes as int8
(`int8_weight`: symmetric ones minus their zero point 128; asymmetric ones, up to 255 from
their zero points, minus 128 with their zero points minus 128 beside them), so every quantized
path (tensor parallel slicing, MoE experts, the Triton W4A16 / W8A16 matmul) serves it at half
a byte or one byte per weight. In activation order the columns are stored
sorted by group, with the order of the inputs they take (`input_order`): a projection then
gathers its input in that order before the matmul.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ksana_llm.loader.json_files import read_json_object
from ksana_llm.loader.quantized_weight import (QuantizedWeight, in_input_order, int4_weight,
                                               int8_weight)
from ksana_llm.loader.weight_quant import unpack_words


# The n-th 4-bit field of an AWQ word holds output column AWQ_PACK_ORDER[n] of its 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Files older GPTQ / AWQ checkpoints keep their settings in, beside a config.json without
# `quantization_config` (AutoGPTQ's quantize_config.json, AutoAWQ's quant_config.json).
SIDE_CONFIG_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


@dataclass(frozen=True)
class PackedIntFormat:
    """What a GPTQ / AWQ `quantization_config` says of the checkpoint's tensors."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group spans every input (one scale per output)
    desc_act: bool = False  # GPTQ activation order: `g_idx` decides each input's group
    zero_offset: int = 0  # added to every stored zero point (1 for GPTQ's v1 format)

    @classmethod
    def from_quantization(cls, quantization: dict[str, Any]) -> PackedIntFormat:
        method = quantization.get("quant_method")
        bits = _config_int(quantization.get("bits", quantization.get("w_bit", 4)), "bits")
        group_size = _config_int(quantization.get("group_size", quantization.get("q_group_size", -1)),
                                 "group_size")
        where = "quantization_config"
        if group_size == 0 or group_size < -1:
            raise ValueError(f"{where}.group_size must be positive or -1, got {group_size}")
        if method == "gptq":
            if bits not in (4, 8):
                raise ValueError(f"{where}.bits {bits} is not supported for GPTQ (4 or 8)")
            fmt = "marlin" if quantization.get("is_marlin_format") \
                else str(quantization.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"{where}.checkpoint_format {fmt!r} is not supported "
                                 "(GPTQ's 'gptq' and 'gptq_v2' layouts are; re-save a Marlin "
                                 "checkpoint in the GPTQ layout)")
            if quantization.get("dynamic"):
                raise ValueError(f"{where}.dynamic (per-module GPTQ settings) is not supported")
            return cls("gptq", bits, group_size, bool(quantization.get("desc_act", False)),
                       zero_offset=1 if fmt == "gptq" else 0)
        if method == "awq":
            version = str(quantization.get("version", "gemm")).lower()
            if version != "gemm" or bits != 4:
                raise ValueError(f"{where}: AWQ version {version!r} with {bits}-bit weights is "
                                 "not supported (4-bit 'gemm' checkpoints are)")
            if not quantization.get("zero_point", True):
                raise ValueError(f"{where}.zero_point false (AWQ without zero points) is not "
                                 "supported")
            return cls("awq", bits, group_size)
        raise ValueError(f"{where}.quant_method {method!r} is not a GPTQ or AWQ method")


def _config_int(value: Any, key: str) -> int:
    """An integer setting of quantization_config (JSON numbers, or their text as some exporters
    write it); ValueError naming the key otherwise."""
    text = str(value).strip()
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not (
            text.isdecimal() or (text.startswith("-") and text[1:].isdecimal())):
        raise ValueError(f"quantization_config.{key} must be an integer, got {value!r}")
    return int(text)


def side_config(model_dir: str | Path) -> dict[str, Any] | None:
    """The GPTQ / AWQ settings of a checkpoint that keeps them beside config.json (older
    AutoGPTQ and AutoAWQ checkpoints), with the method they imply; None without such a file."""
    for filename, method in SIDE_CONFIG_FILES:
        path = Path(model_dir) / filename
        if path.is_file():
            settings = read_json_object(path)
            return {"quant_method": method, **settings}
    return None


# Checkpoint names of a packed weight's parts; `g_idx` only in GPTQ checkpoints.
PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def paired_packed_ints(weights: Iterable[tuple[str, torch.Tensor]], fmt: PackedIntFormat
                       ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each packed weight's parts joined, as soon as all have
    come, into one weight under `<name>.weight` (see `packed_int_weight`); everything else as it
    is. `g_idx` is awaited only in activation order: otherwise it must be the plain grouping,
    and one that comes after its weight is only checked."""
    needed = {"qweight", "qzeros", "scales"}
    if fmt.desc_act:
        needed.add("g_idx")
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, leaf = name.rpartition(".")
        if leaf not in PACKED_PARTS:
            yield name, tensor
            continue
        if leaf == "g_idx" and not fmt.desc_act and base not in waiting:
            _check_plain_groups(tensor, fmt, name)  # its weight has gone already
            continue
        parts = waiting.setdefault(base, {})
        parts[leaf] = tensor
        if needed <= parts.keys():
            del waiting[base]
            yield f"{base}.weight", packed_int_weight(parts, fmt, f"{base}.weight")
    if waiting:
        incomplete = {base: sorted(parts) for base, parts in list(waiting.items())[:5]}
        raise ValueError(f"{fmt.method.upper()} weights missing parts (have {incomplete}; each "
                         f"needs {sorted(needed)})")


def packed_int_weight(parts: dict[str, torch.Tensor], fmt: PackedIntFormat, name: str
                      ) -> torch.Tensor | QuantizedWeight:
    """One GPTQ / AWQ weight as [out, in] numbers: held exactly as packed 4-bit codes
    (`int4_weight`) or int8 codes (`int8_weight`) with group scales and zero points (in
    activation order, columns sorted by group with their `input_order`); float32 values where
    activation order makes groups of other sizes."""
    codes, zeros = _gptq_codes(parts, fmt) if fmt.method == "gptq" else _awq_codes(parts, fmt)
    out_features, in_features = codes.shape
    scales = parts["scales"].to(torch.float32)
    groups = scales.shape[0]
    group_size = in_features if fmt.group_size == -1 else fmt.group_size
    if scales.shape != (-(-in_features // group_size), out_features) \
            or zeros.shape != scales.shape:
        raise ValueError(f"{name}: scales {tuple(scales.shape)} and zero points "
                         f"{tuple(zeros.shape)} do not cover a [{out_features}, {in_features}] "
                         f"weight in groups of {group_size} inputs")
    group_of_input = _plain_groups(in_features, group_size)
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        if g_idx.shape != (in_features,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{name}: g_idx of shape {tuple(g_idx.shape)} does not give each "
                             f"of {in_features} inputs one of {groups} groups")
        if not fmt.desc_act:
            _check_plain_groups(g_idx, fmt, name)
        group_of_input = g_idx.to(torch.long)
    zeros = zeros.to(torch.int16) + fmt.zero_offset
    input_order = None
    if not torch.equal(group_of_input, _plain_groups(in_features, group_size)):
        # Activation order: the inputs sorted by group make whole groups again.
        input_order = torch.argsort(group_of_input, stable=True)
        group_of_input = group_of_input[input_order]
        codes = codes[:, input_order]
        if not torch.equal(group_of_input, _plain_groups(in_features, group_size)):
            # Groups of other sizes than group_size: each input's own scale, in float32
            # (exact: an fp16 scale times an integer below 512), columns in input order.
            values = codes.to(torch.float32) - zeros.t()[:, group_of_input].to(torch.float32)
            return in_input_order(values * scales.t()[:, group_of_input], input_order)
    make = int4_weight if fmt.bits == 4 else int8_weight
    return make(codes, zeros.t(), scales.t(), group_size, input_order)


def _gptq_codes(parts: dict[str, torch.Tensor], fmt: PackedIntFormat
                ) -> tuple[torch.Tensor, torch.Tensor]:
    # qweight packs along the inputs: its transpose's words unpack to [out, in] directly.
    codes = unpack_words(parts["qweight"].t(), fmt.bits)
    zeros = unpack_words(parts["qzeros"], fmt.bits)[:, :codes.shape[0]]
    return codes, zeros


def _awq_codes(parts: dict[str, torch.Tensor], fmt: PackedIntFormat
               ) -> tuple[torch.Tensor, torch.Tensor]:
    codes = _awq_columns(unpack_words(parts["qweight"], fmt.bits))  # [in, out]
    zeros = _awq_columns(unpack_words(parts["qzeros"], fmt.bits))  # [groups, out]
    return codes.t(), zeros


def _awq_columns(fields: torch.Tensor) -> torch.Tensor:
    """Fields in AWQ's interleaved packing order back in column order."""
    rows, cols = fields.shape
    per_word = len(AWQ_PACK_ORDER)
    if cols % per_word:
        raise ValueError(f"AWQ packing: {cols} columns are not whole words of {per_word}")
    # Field n of a word holds column AWQ_PACK_ORDER[n]: scatter each field to its column.
    columns = torch.empty_like(fields).view(rows, -1, per_word)
    columns[:, :, list(AWQ_PACK_ORDER)] = fields.view(rows, -1, per_word)
    return columns.view(rows, cols)


def _plain_groups(in_features: int, group_size: int) -> torch.Tensor:
    return torch.arange(in_features) // group_size


def _check_plain_groups(g_idx: torch.Tensor, fmt: PackedIntFormat, name: str) -> None:
    group_size = g_idx.numel() if fmt.group_size == -1 else fmt.group_size
    if not torch.equal(g_idx.to(torch.long), _plain_groups(g_idx.numel(), group_size)):
        raise ValueError(f"{name}: g_idx puts inputs out of group order, but "
                         "quantization_config.desc_act is false")
