"""Building a model's module from a checkpoint folder: the class from the registry, built on the
meta device, moved to its device, filled from the checkpoint (through a weight map if there is
one). Used by `Model.from_pretrained` and by the worker ranks of a parallel run, which load only
their own shard."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.linear import QuantizedStorage
from ksana_llm.layers.moe import FusedExperts
from ksana_llm.layers.parallel import check_heads_divisible, kv_head_shard
from ksana_llm.loader import find_weight_map, iterate_weights, load_hf_config, load_weight_map
from ksana_llm.loader.fp8_weights import WEIGHT_QUANTIZATIONS
from ksana_llm.loader.load_format import dummy_weights
from ksana_llm.loader.quantized import (checkpoint_quantization, paired_quantized,
                                        quantization_settings)
from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.models.llama import LlamaForCausalLM
from ksana_llm.models.registry import model_class_for
from ksana_llm.models.sequence_classification import (HeadTensors, backbone_config,
                                                      classification_architecture,
                                                      head_from_tokens)
from ksana_llm.models.weight_loading import with_base_model_prefix

logger = logging.getLogger("ksana_llm.model")


def model_class(hf_config: Any, weight_map_path: Path | None) -> type[nn.Module]:
    """The registry's class; for a family it does not know, Llama when a weight map was found
    (KsanaLLM's rule: a map means "Llama with other tensor names")."""
    try:
        return model_class_for(hf_config)
    except ValueError as exc:
        if weight_map_path is None:
            model_type = getattr(hf_config, "model_type", None)
            raise ValueError(f"{exc}; a model with Llama's structure under other tensor names "
                             f"loads through a {model_type}_weight_map.json in its folder") from exc
    logger.info("model_type %r is not a known family; loading it as Llama through the weight map %s",
                getattr(hf_config, "model_type", None), weight_map_path)
    return LlamaForCausalLM


def build_module(model_cls: type[nn.Module], hf_config: Any,
                 parallel: ParallelContext | None) -> nn.Module:
    if parallel is None or parallel.world_size == 1:
        return model_cls(hf_config)
    if not getattr(model_cls, "supports_parallel", False):
        raise ValueError(f"{model_cls.__name__} does not support tensor or pipeline parallelism "
                         "yet; run it with tensor_parallel_size 1")
    return model_cls(hf_config, parallel=parallel)


def check_parallel_sizes(model_dir: str | Path, hf_config: Any, tp_size: int, pp_size: int) -> None:
    """Refuse a split the model cannot take before any worker process is started."""
    if tp_size * pp_size == 1:
        return
    model_cls = model_class(hf_config, find_weight_map(model_dir, getattr(hf_config, "model_type", None)))
    if not getattr(model_cls, "supports_parallel", False):
        raise ValueError(f"{model_cls.__name__} does not support tensor or pipeline parallelism "
                         "yet; run it with tensor_parallel_size 1")
    ctx = ParallelContext(tp_size=tp_size, pp_size=pp_size)
    heads = getattr(hf_config, "num_attention_heads", None)
    if heads:
        check_heads_divisible(heads, ctx)
        if not getattr(hf_config, "kv_lora_rank", None):  # MLA caches a latent, not KV heads
            kv_head_shard(getattr(hf_config, "num_key_value_heads", None) or heads, ctx)
    layers = getattr(hf_config, "num_hidden_layers", None)
    if layers and pp_size > layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} is more than the model's {layers} layers")


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(WEIGHT_QUANTIZATIONS)}, "
                         f"got {quantization!r}")


def quantize_projections_on_load(module: nn.Module, method: str) -> int:
    """Online quantization ("fp8", "w8a8_int8"): every projection and MoE expert stack that can
    keep quantized weights quantizes them per row as they load (embeddings, norms, the LM head
    and routers stay as they are); how many modules."""
    projections = [m for m in module.modules()
                   if isinstance(m, (QuantizedStorage, FusedExperts)) and m.quantized_capable]
    for projection in projections:
        projection.online_quantization = method
    return len(projections)


def load_model_module(model_dir: str | Path, *, device: torch.device, dtype: torch.dtype | str,
                      parallel: ParallelContext | None = None, progress: bool = True,
                      hf_config: Any = None, quantization: str | None = None,
                      load_format: str = "auto") -> tuple[nn.Module, torch.dtype]:
    """(module with its weights loaded, in eval mode; its dtype). An FP8 checkpoint's projections
    stay FP8; `quantization` "fp8" makes a full-precision checkpoint's projections FP8,
    "w8a8_int8" int8 with their inputs quantized to int8 per token. `load_format`: where the
    weights come from (`ksana_llm.loader.load_format`)."""
    check_quantization(quantization)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    hf_config = hf_config if hf_config is not None else load_hf_config(model_dir)
    checkpoint_format = checkpoint_quantization(hf_config, model_dir)
    if checkpoint_format is not None and getattr(hf_config, "quantization_config", None) is None:
        # Settings kept beside config.json (older GPTQ / AWQ checkpoints) on the config, where
        # the model's layers read the scale groups their tensor-parallel splits keep whole.
        hf_config.quantization_config = quantization_settings(hf_config, model_dir)
    if load_format == "dummy" and checkpoint_format is not None:
        raise ValueError(f"load_format 'dummy' makes unquantized weights; {model_dir} holds a "
                         f"{checkpoint_format} checkpoint")
    weight_map_path = find_weight_map(model_dir, getattr(hf_config, "model_type", None))
    if weight_map_path is not None:  # a broken map should fail in milliseconds, not after a build
        load_weight_map(weight_map_path)
    model_cls = model_class(hf_config, weight_map_path)
    # A classifier's `score` head is taken out of the stream, its decoder built as an LM's.
    head_tensors = (HeadTensors(hf_config, head_from_tokens(hf_config))
                    if classification_architecture(hf_config) else None)
    # Build on the meta device so no memory is touched before the real weights arrive.
    with torch.device("meta"):
        module = build_module(model_cls, backbone_config(hf_config), parallel)
    module = module.to(torch_dtype).to_empty(device=device)
    if quantization is not None and checkpoint_format is None:
        logger.info("quantizing %d projections to %s (per-row scales) as they load",
                    quantize_projections_on_load(module, quantization),
                    "FP8" if quantization == "fp8" else "int8, their inputs int8 per token")
    elif quantization is not None:
        logger.info("quantization %r ignored: the checkpoint is quantized already", quantization)
    weights = (dummy_weights(hf_config, sequence_classification=head_tensors is not None,
                             norm_offsets=getattr(model_cls, "stores_norm_offsets", False))
               if load_format == "dummy" else
               with_base_model_prefix(module, checkpoint_tensors(
                   model_dir, hf_config, progress=progress, load_format=load_format)))
    if head_tensors is None:
        module.load_weights(weights)
    else:
        module.lm_head_unused = True
        module.load_weights(head_tensors.decoder_tensors(weights))
        module.classifier = head_tensors.head()
    return module.eval(), torch_dtype


def checkpoint_tensors(model_dir: str | Path, hf_config: Any, *, progress: bool = True,
                       shapes_only: bool = False, load_format: str = "auto"
                       ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The folder's tensors as a model's `load_weights` takes them: a quantized checkpoint's
    values paired with their scales, names through the folder's (or the package's) weight map.
    `shapes_only` (a dry run): the matrices of an unquantized checkpoint come as meta tensors,
    their values never read (a quantized one's are read: pairing reads its scales)."""
    checkpoint_format = checkpoint_quantization(hf_config, model_dir)
    weights: Iterator = iterate_weights(
        model_dir, progress=progress, matrices_as_meta=shapes_only and checkpoint_format is None,
        load_format=load_format)
    if checkpoint_format is not None:
        # Paired before the weight map renames anything, so a map needs no scale entries.
        weights = paired_quantized(weights, checkpoint_format)
    return renamed_by_weight_map(weights, model_dir, hf_config)


def renamed_by_weight_map(weights: Iterable[tuple[str, Any]], model_dir: str | Path,
                          hf_config: Any) -> Iterator[tuple[str, Any]]:
    """`weights` renamed by the weight map `model_dir` (or the package) has for its model type;
    unchanged without one."""
    weight_map_path = find_weight_map(model_dir, getattr(hf_config, "model_type", None))
    if weight_map_path is None:
        return iter(weights)
    logger.info("renaming checkpoint tensors with %s", weight_map_path)
    return load_weight_map(weight_map_path).apply(weights)
