"""Maps a checkpoint's `architectures` (or `model_type`) to our model class."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from torch import nn

from ksana_llm.models.baichuan import BaichuanForCausalLM
from ksana_llm.models.cohere import Cohere2ForCausalLM, CohereForCausalLM
from ksana_llm.models.deepseek_v2 import DeepseekV2ForCausalLM
from ksana_llm.models.deepseek_v3 import DeepseekV3ForCausalLM
from ksana_llm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from ksana_llm.models.glm import Glm4ForCausalLM, GlmForCausalLM
from ksana_llm.models.gpt_oss import GptOssForCausalLM
from ksana_llm.models.granite import GraniteForCausalLM
from ksana_llm.models.internlm import InternLM2ForCausalLM, InternLM3ForCausalLM
from ksana_llm.models.llama import LlamaForCausalLM, MistralForCausalLM
from ksana_llm.models.mixtral import MixtralForCausalLM
from ksana_llm.models.phi3 import Phi3ForCausalLM
from ksana_llm.models.olmo2 import Exaone4ForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM
from ksana_llm.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, QWenLMHeadModel
from ksana_llm.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from ksana_llm.models.smollm3 import SmolLM3ForCausalLM
from ksana_llm.models.starcoder2 import Starcoder2ForCausalLM

_ARCHITECTURES: Mapping[str, type[nn.Module]] = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 1/2/3, Yi, SmolLM2, Vicuna
    # Llama's layout, sliding window from the config; Mistral Small 3.1 / 3.2
    # (Mistral3ForConditionalGeneration) as its language model, for text
    # (loader.multimodal_text)
    "MistralForCausalLM": MistralForCausalLM,
    "YiForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,  # SmolLM3-3B (NoPE every 4th layer)
    "Qwen2ForCausalLM": Qwen2ForCausalLM,  # Qwen1.5, Qwen2, Qwen2.5
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "QWenLMHeadModel": QWenLMHeadModel,  # Qwen (v1)
    "BaichuanForCausalLM": BaichuanForCausalLM,  # Baichuan-13B, Baichuan2-7B/13B
    "BaiChuanForCausalLM": BaichuanForCausalLM,  # Baichuan-7B spells it this way
    "MixtralForCausalLM": MixtralForCausalLM,  # Mixtral 8x7B / 8x22B
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,  # Qwen1.5-MoE, Qwen2-57B-A14B
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,  # Qwen3-30B-A3B, 235B-A22B
    "GptOssForCausalLM": GptOssForCausalLM,  # gpt-oss-20b / 120b (MXFP4 experts dequantized)
    "Phi3ForCausalLM": Phi3ForCausalLM,  # Phi-3 / 3.5 mini, medium, Phi-4, Phi-4-mini
    "Olmo2ForCausalLM": Olmo2ForCausalLM,  # OLMo 2 1B / 7B / 13B / 32B
    "Olmo3ForCausalLM": Olmo3ForCausalLM,  # OLMo 3 7B / 32B
    "Exaone4ForCausalLM": Exaone4ForCausalLM,  # EXAONE 4.0 1.2B / 32B
    "InternLM2ForCausalLM": InternLM2ForCausalLM,  # InternLM 2 / 2.5 (remote-code configs)
    "InternLM3ForCausalLM": InternLM3ForCausalLM,  # InternLM 3 8B (remote-code config)
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,  # StarCoder 2 3B / 7B / 15B
    "CohereForCausalLM": CohereForCausalLM,  # Command R, R+, Aya 23 / Expanse
    "Cohere2ForCausalLM": Cohere2ForCausalLM,  # Command R7B, Command A
    "GraniteForCausalLM": GraniteForCausalLM,  # IBM Granite 3.x dense
    "GlmForCausalLM": GlmForCausalLM,  # glm-4-9b(-chat)-hf
    "Glm4ForCausalLM": Glm4ForCausalLM,  # GLM-4-9B/32B-0414, GLM-Z1
    "GemmaForCausalLM": GemmaForCausalLM,  # Gemma 2B / 7B, CodeGemma
    "Gemma2ForCausalLM": Gemma2ForCausalLM,  # Gemma 2 2B / 9B / 27B
    # Gemma 3 1B; 4B-27B (Gemma3ForConditionalGeneration) as their language model, for text
    # (loader.multimodal_text)
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,  # DeepSeek-V2, V2-Lite, V2.5, Coder-V2
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,  # DeepSeek-V3, R1 (MLA + DeepSeek MoE)
    # Classifiers, reward models, cross-encoder rerankers: the LM's decoder with a `score` head
    # (models/sequence_classification.py)
    "LlamaForSequenceClassification": LlamaForCausalLM,
    "MistralForSequenceClassification": MistralForCausalLM,
    "Qwen2ForSequenceClassification": Qwen2ForCausalLM,
    "Qwen3ForSequenceClassification": Qwen3ForCausalLM,
    "GemmaForSequenceClassification": GemmaForCausalLM,  # also bge-reranker-v2-gemma's recipe
    "Gemma2ForSequenceClassification": Gemma2ForCausalLM,
    "Gemma3TextForSequenceClassification": Gemma3ForCausalLM,
})
_MODEL_TYPES: Mapping[str, type[nn.Module]] = MappingProxyType({
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "yi": LlamaForCausalLM,
    "smollm3": SmolLM3ForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen": QWenLMHeadModel,
    "baichuan": BaichuanForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "phi3": Phi3ForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "olmo3": Olmo3ForCausalLM,
    "exaone4": Exaone4ForCausalLM,
    "internlm2": InternLM2ForCausalLM,
    "internlm3": InternLM3ForCausalLM,
    "starcoder2": Starcoder2ForCausalLM,
    "cohere": CohereForCausalLM,
    "cohere2": Cohere2ForCausalLM,
    "granite": GraniteForCausalLM,
    "glm": GlmForCausalLM,
    "glm4": Glm4ForCausalLM,
    "gemma": GemmaForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
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
