"""Which quantized format a checkpoint holds, and its tensors paired up for loading: FP8 and
compressed-tensors checkpoints (`fp8_weights`), GPTQ and AWQ ones (`gptq_awq`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ksana_llm.loader.fp8_weights import QuantizedCheckpoint, paired_weights
from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.loader.weight_quant import MXFP4_BLOCK
from ksana_llm.loader.gptq_awq import PackedIntFormat, paired_packed_ints, side_config

logger = logging.getLogger(__name__)

CheckpointQuantization = QuantizedCheckpoint | PackedIntFormat


def quantization_settings(hf_config: Any, model_dir: str | Path | None = None
                          ) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict: from config.json, or from the file
    older GPTQ / AWQ checkpoints keep it in; None for a full-precision checkpoint."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return side_config(model_dir) if model_dir is not None else None
    if isinstance(quantization, dict):
        return quantization
    return quantization.to_dict() if hasattr(quantization, "to_dict") else vars(quantization)


def checkpoint_quantization(hf_config: Any, model_dir: str | Path | None = None
                            ) -> CheckpointQuantization | None:
    """The format of a quantized checkpoint; None for a full-precision one. A method ksana-llm
    cannot load is refused by name (`ValueError`)."""
    quantization = quantization_settings(hf_config, model_dir)
    if quantization is None:
        return None
    if quantization.get("quant_method") == "mxfp4":
        # GPT-OSS's experts: the family pairs their blocks and scales itself
        # (models/gpt_oss.py); the rest of such a checkpoint is full precision.
        return None
    if quantization.get("quant_method") in ("gptq", "awq"):
        fmt = PackedIntFormat.from_quantization(quantization)
        if fmt.desc_act:
            logger.info("GPTQ weights in activation order (desc_act): held quantized with the "
                        "order their inputs are gathered in; a tensor-parallel rank's slice of "
                        "the inputs loads dequantized to the model's dtype")
        return fmt
    return QuantizedCheckpoint.from_quantization(quantization)


def input_scale_group(hf_config: Any) -> int:
    """How many input columns one of the checkpoint's weight scales covers (1: a scale per row
    or per tensor, or no quantization), from `quantization_config`: MXFP4's blocks of 32, FP8's
    `weight_block_size`, GPTQ / AWQ's `group_size` (but 1 in activation order, whose slices
    load dequantized), compressed-tensors' group or block sizes: what a tensor-parallel split
    of an MLP's inputs takes into account (`layers.parallel.scale_aligned_split`). Read before
    any tensor loads (`models.factory.load_model_module` puts settings kept beside config.json,
    older GPTQ / AWQ checkpoints', on the config first); 1 for anything it cannot read
    (`checkpoint_quantization` refuses what cannot load)."""
    quantization = quantization_settings(hf_config)
    if not quantization:
        return 1
    method = quantization.get("quant_method")
    sizes: list[Any] = []
    if method == "mxfp4":
        sizes = [MXFP4_BLOCK]
    elif method == "fp8":
        sizes = [(quantization.get("weight_block_size") or [1, 1])[-1]]
    elif method in ("gptq", "awq") and not quantization.get("desc_act"):
        sizes = [quantization.get("group_size", quantization.get("q_group_size", 1))]
    elif method == "compressed-tensors":
        for group in (quantization.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            if weights.get("strategy") == "group":
                sizes.append(weights.get("group_size"))
            elif weights.get("strategy") == "block":
                sizes.append((weights.get("block_structure") or [1, 1])[-1])
    usable = [int(size) for size in sizes
              if isinstance(size, (int, str)) and str(size).isdigit() and int(size) > 0]
    return math.lcm(*usable) if usable else 1


def paired_quantized(weights: Iterable[tuple[str, torch.Tensor]], fmt: CheckpointQuantization
                     ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each quantized weight's parts joined into one weight."""
    if isinstance(fmt, PackedIntFormat):
        return paired_packed_ints(weights, fmt)
    return paired_weights(weights, fmt)
