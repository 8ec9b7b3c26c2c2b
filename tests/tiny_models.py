"""Tiny random checkpoints built with transformers, saved as real HF folders, for parity tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)


def deepseek_config(**overrides) -> DeepseekV3Config:
    """tests/deepseek_checkpoint.py's tiny DeepSeek-V3, imported when first built: imported with
    this module (so before most test modules at collection), it made a whole-suite run's
    in-process SmolLM2 logits differ from transformers' by up to 5e-3 (cause not found; not
    reproducible outside pytest)."""
    from tests.deepseek_checkpoint import deepseek_config as tiny_deepseek

    return tiny_deepseek(**overrides)

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY_CONFIGS = {
    "llama2": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama3-rope-scaling": lambda: LlamaConfig(
        **{**COMMON, "max_position_embeddings": 1024}, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}),
    # YaRN, as Qwen2.5's model cards add it for long context: the test prompts (40 tokens)
    # reach past the original 16 positions, and cos/sin carry the attention factor.
    "qwen2-yarn": lambda: Qwen2Config(
        **COMMON, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16}),
    "smollm-tied-mha": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 4},
                                           tie_word_embeddings=True),
    "yi-gqa4-bias": lambda: LlamaConfig(**{**COMMON, "num_attention_heads": 8,
                                           "num_key_value_heads": 2, "head_dim": 16},
                                        attention_bias=True, tie_word_embeddings=False),
    "mistral-sliding": lambda: MistralConfig(**COMMON, sliding_window=24, tie_word_embeddings=False),
    # A Llama config carrying a window key (some fine-tunes do): transformers' Llama ignores it.
    "llama-window-key": lambda: LlamaConfig(**COMMON, sliding_window=16, tie_word_embeddings=False),
    # q/k norms (per head, before RoPE), head_dim wider than hidden / heads
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
    # 8 experts, top 2, q/k norms (tests/test_family_moe.py holds the MoE families' own checks)
    "qwen3-moe": lambda: Qwen3MoeConfig(**{**COMMON, "intermediate_size": 96}, head_dim=32,
                                        moe_intermediate_size=32, num_experts=8,
                                        num_experts_per_tok=2, norm_topk_prob=True,
                                        tie_word_embeddings=False),
    # MLA + grouped-topk MoE (tests/test_family_deepseek.py holds the family's own checks)
    "deepseek-v3": lambda: deepseek_config(max_position_embeddings=512),
}
MODEL_CLASSES = {LlamaConfig: LlamaForCausalLM, MistralConfig: MistralForCausalLM,
                 Qwen2Config: Qwen2ForCausalLM,
                 Qwen3Config: Qwen3ForCausalLM, Qwen3MoeConfig: Qwen3MoeForCausalLM, DeepseekV3Config: DeepseekV3ForCausalLM}


def build_tiny_model(name: str, folder: Path, *, safe_serialization: bool = True,
                     seed: int = 0) -> torch.nn.Module:
    """Create, save and return the HF reference model (fp32, eval mode)."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[name]()
    model = MODEL_CLASSES[type(config)](config).eval()
    perturb_biases_and_norms(model)
    model.save_pretrained(folder, safe_serialization=safe_serialization)
    return model


def perturb_biases_and_norms(model: torch.nn.Module) -> None:
    """Random init leaves biases at 0 and q/k norm weights at 1; give them values so that a
    dropped bias or norm weight would be noticed."""
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0, 0.1)
            elif param_name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1, 0.2)


def build_tiny_chat_model(folder: Path, tokenizer_dir: Path, *, num_hidden_layers: int = 3,
                          seed: int = 0) -> torch.nn.Module:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (`tokenizer_dir`), which
    a server needs: 4 heads, 2 KV heads, tied embeddings (3 layers split over 2 ranks (TP) and
    2 stages (PP)). Saved in `folder`; the transformers model is returned."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer),
                         max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, Path(folder) / name)
    return hf
