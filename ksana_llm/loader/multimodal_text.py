"""Multimodal checkpoints served for their text alone (Gemma 3 4B-27B, Mistral Small 3.1 / 3.2):
the config's `text_config` under the language model's architecture, and the checkpoint's
language-model tensors under a causal LM's names. Image inputs are refused by the chat route as
for any text model; the vision tower and projector are not loaded."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from types import MappingProxyType
from typing import Any

logger = logging.getLogger("ksana_llm.loader")

# Architecture -> its language model's.
_LANGUAGE_MODELS = MappingProxyType({
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",
})
# What the composite config holds for the whole checkpoint and the text model needs too.
_SHARED_KEYS = ("quantization_config", "tie_word_embeddings")
# The checkpoint's prefixes (the hub's, and transformers 5's module names) -> a causal LM's; and
# the parts served text-only leaves out.
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head."),
                            ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def language_model_config(config: Any) -> Any:
    """A multimodal checkpoint's `text_config` under the language model's architecture, holding
    the composite's quantization and head tying, and marked (`multimodal_checkpoint`) so its
    tensors are renamed as they load. Other configs come back as they are."""
    architectures = list(getattr(config, "architectures", None) or [])
    text = getattr(config, "text_config", None)
    language_model = next((_LANGUAGE_MODELS[a] for a in architectures if a in _LANGUAGE_MODELS),
                          None)
    if language_model is None or text is None:
        return config
    for key in _SHARED_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            setattr(text, key, value)
    text.architectures = [language_model]
    text.multimodal_checkpoint = architectures[0]
    logger.info("%s: serving its language model (%s) for text; the vision tower is not loaded",
                architectures[0], language_model)
    return text


def language_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor or module name under a causal LM's; None for the parts
    served text-only leaves out (the vision tower, the projector)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, ours in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


def language_model_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A multimodal checkpoint's language-model tensors, under a causal LM's names."""
    for name, tensor in weights:
        renamed = language_model_name(name)
        if renamed is not None:
            yield renamed, tensor
