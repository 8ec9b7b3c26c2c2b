"""Maps a checkpoint's `architectures` (or `model_type`) to our model class."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from torch import nn

from ksana_llm.models.llama import LlamaForCausalLM

_ARCHITECTURES: Mapping[str, type[nn.Module]] = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 1/2/3, Yi, SmolLM2, Vicuna
    "MistralForCausalLM": LlamaForCausalLM,  # same layout; sliding window from the config
    "YiForCausalLM": LlamaForCausalLM,
})
_MODEL_TYPES: Mapping[str, type[nn.Module]] = MappingProxyType({
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "yi": LlamaForCausalLM,
})


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class_for(config: Any) -> type[nn.Module]:
    """The class for a HF config; ValueError listing what is supported otherwise."""
    for arch in getattr(config, "architectures", None) or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    model_type = getattr(config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"unsupported model: architectures={getattr(config, 'architectures', None)}, "
        f"model_type={model_type!r}; supported architectures: {', '.join(supported_architectures())}")
