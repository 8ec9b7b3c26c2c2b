"""Qwen families vs a transformers reference on the same weights (fp32), through the paged KV
cache, chunked prefill, a prefix-cache hit and the real Engine (tests/family_harness.py):

- Qwen2 (Qwen1.5 / Qwen2 / Qwen2.5): q/k/v bias; untied, tied, and a sliding window on every layer;
- Qwen3: RMSNorm on q and k heads, head_dim * heads != hidden;
- Qwen v1 (`QWenLMHeadModel`, remote code, so no transformers class): a checkpoint in Qwen v1's
  own tensor names (`transformer.h.N.attn.c_attn`, `mlp.w1/w2/c_proj`, ...) and config keys
  (`kv_channels`, `layer_norm_epsilon`, `seq_length`, ...), loaded through the shipped
  `qwen_weight_map.json`; the reference is transformers' Qwen2 with the same weights rearranged
  (Qwen v1 is Qwen2 with one fused, biased c_attn and no GQA).

Each checkpoint is saved as safetensors and as pytorch_model.bin; the harness runs on the first,
and the second must load into identical parameters (and match at prefill and decode).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ksana_llm.api.model import Model
from ksana_llm.loader import load_hf_config
from ksana_llm.models import qwen as ours_qwen
from tests.family_harness import (check_family, check_other_format, write_checkpoint,
                                  hf_reference, load_ours, save_both_formats)

VOCAB = 256
COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "bos_token_id": 1,
          "eos_token_id": 2}


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random init leaves biases at 0 and norm weights at 1: move them, so that a dropped bias or
    a skipped q/k norm changes the logits."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
            elif "norm" in name:
                param.normal_(1, 0.1)
    return model.eval()


HF_VARIANTS = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(
        **COMMON, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2.5-tied": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True)),
    # max_window_layers=0: every layer is windowed (the only mix our runner serves).
    "qwen2-sliding": lambda: Qwen2ForCausalLM(Qwen2Config(
        **COMMON, tie_word_embeddings=False, use_sliding_window=True, sliding_window=24,
        max_window_layers=0)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)),
}
EXPECTED_CLASS = {"qwen2": "Qwen2ForCausalLM", "qwen2.5-tied": "Qwen2ForCausalLM",
                  "qwen2-sliding": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_transformers_families_match(variant, tmp_path):
    """Every check of the harness on the safetensors folder; the .bin folder loads the same."""
    torch.manual_seed(0)
    hf = randomize(HF_VARIANTS[variant]())
    folders = save_both_formats(hf, tmp_path)
    reference = hf_reference(hf)
    ours = load_ours(folders["safetensors"])
    assert type(ours).__name__ == EXPECTED_CLASS[variant]
    if variant == "qwen2-sliding":
        assert ours.sliding_window == 24
    else:
        assert ours.sliding_window is None  # released configs keep sliding_window set, unused
    check_family(ours, folders["safetensors"], reference, vocab=VOCAB)
    check_other_format(ours, folders["bin"], reference, vocab=VOCAB)


def test_qwen2_mixed_window_layers_are_refused(tmp_path):
    """Windowed layers from max_window_layers on, full attention below: our runner has one
    window for the whole model, so loading says so instead of serving wrong logits."""
    hf = Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=24,
                                      max_window_layers=1))
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="max_window_layers"):
        Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False)


# ---- Qwen v1 --------------------------------------------------------------------------------------

SEQ_LENGTH = 256


def qwen_v1_config(**overrides) -> dict:
    """A Qwen v1 config.json in its own key names (as the remote-code QWenConfig writes it)."""
    config = {
        "architectures": ["QWenLMHeadModel"], "model_type": "qwen",
        "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                     "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "kv_channels": 16,
        # Qwen v1 states w1 and w2 together: twice the MLP width.
        "intermediate_size": 2 * COMMON["intermediate_size"], "vocab_size": VOCAB,
        "layer_norm_epsilon": 1e-5, "seq_length": SEQ_LENGTH, "max_position_embeddings": 512,
        "rotary_emb_base": 10000, "rotary_pct": 1.0, "scale_attn_weights": True, "no_bias": True,
        # On in every released Qwen v1 config; they change nothing below seq_length.
        "use_dynamic_ntk": True, "use_logn_attn": True, "use_flash_attn": "auto",
        "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


def qwen_v1_reference() -> Qwen2ForCausalLM:
    """transformers' Qwen2 shaped like the Qwen v1 checkpoint: no GQA, biased q/k/v."""
    torch.manual_seed(1)
    config = Qwen2Config(**{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return randomize(Qwen2ForCausalLM(config), seed=1)


def qwen_v1_tensors(hf: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    """The reference's weights under Qwen v1's names: q/k/v fused into c_attn, w2 the gate."""
    sd = hf.state_dict()
    out = {"transformer.wte.weight": sd["model.embed_tokens.weight"],
           "transformer.ln_f.weight": sd["model.norm.weight"],
           "lm_head.weight": sd["lm_head.weight"]}
    for i in range(hf.config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            out[dst + f"attn.c_attn.{kind}"] = torch.cat(
                [sd[src + f"self_attn.{p}_proj.{kind}"] for p in "qkv"])
        out[dst + "attn.c_proj.weight"] = sd[src + "self_attn.o_proj.weight"]
        out[dst + "ln_1.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "ln_2.weight"] = sd[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.w1.weight"] = sd[src + "mlp.up_proj.weight"]
        out[dst + "mlp.w2.weight"] = sd[src + "mlp.gate_proj.weight"]
        out[dst + "mlp.c_proj.weight"] = sd[src + "mlp.down_proj.weight"]
    return {name: t.clone().contiguous() for name, t in out.items()}


@pytest.fixture(scope="module")
def qwen_v1():
    hf = qwen_v1_reference()
    return hf, qwen_v1_tensors(hf)


def test_qwen_v1_matches_rearranged_qwen2(qwen_v1, tmp_path):
    hf, tensors = qwen_v1
    reference = hf_reference(hf)
    folder = write_checkpoint(tmp_path / "safetensors", qwen_v1_config(), tensors, "safetensors")
    ours = load_ours(folder)
    assert isinstance(ours, ours_qwen.QWenLMHeadModel)
    assert ours.max_context == SEQ_LENGTH  # NTK / logn on: capped where they are no-ops
    check_family(ours, folder, reference, vocab=VOCAB)
    # Qwen-VL is a QWenLMHeadModel too: its vision tower rides along and the map drops it.
    with_visual = {**tensors, "transformer.visual.proj": torch.randn(4, 4)}
    check_other_format(ours, write_checkpoint(tmp_path / "bin", qwen_v1_config(), with_visual,
                                              "bin"), reference,
                       vocab=VOCAB)


def test_qwen_v1_context_is_max_positions_without_ntk_or_logn(qwen_v1, tmp_path):
    _, tensors = qwen_v1
    config = qwen_v1_config(use_dynamic_ntk=False, use_logn_attn=False)
    folder = write_checkpoint(tmp_path, config, tensors, "safetensors")
    assert load_ours(folder).max_context == 512


@pytest.mark.parametrize("key,value", [("rotary_pct", 0.5), ("kv_channels", 8),
                                       ("scale_attn_weights", False)])
def test_qwen_v1_unsupported_configs_are_refused(tmp_path, key, value):
    (tmp_path / "config.json").write_text(json.dumps(qwen_v1_config(**{key: value})))
    with pytest.raises(ValueError, match=key):
        ours_qwen.QWenLMHeadModel(load_hf_config(tmp_path))
