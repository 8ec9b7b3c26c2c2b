"""Gemma (1) and Gemma 3 (text) end to end against transformers (fp32).

Tiny random `GemmaForCausalLM` (MQA: one KV head, tied embeddings) and `Gemma3ForCausalLM`
(windowed and full layers interleaved with a 12-token window that the 40-token test prompts
outrun, each kind with its own RoPE, q/k norms, query_pre_attn_scalar, final logit soft-capping)
saved by transformers, their norm weights moved off 0 (Gemma stores them as offsets from 1):
logits at prefill (whole and chunked), at 16 decode steps and on a prefix-cache hit, and greedy
tokens through the Engine (tests/family_harness.py); Gemma 3 also on the Triton kernels. The
Gemma 3 parts that a reference check might pass by luck are undone one at a time and must fail.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig, GemmaForCausalLM

from ksana_llm.layers.attention import AttentionMetadata
from ksana_llm.models.gemma import Gemma3ForCausalLM as OurGemma3
from ksana_llm.models.gemma import GemmaForCausalLM as OurGemma
from ksana_llm.models.gemma import ScaledEmbedding
from tests.family_harness import (check_family, check_prefill_and_decode, check_triton_backend,
                                  hf_reference, load_ours, memoized)

VOCAB = 256
GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def gemma_config(**overrides) -> GemmaConfig:
    return GemmaConfig(**{
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "bos_token_id": 2, "eos_token_id": 1,
        "pad_token_id": 0, **overrides})


def gemma3_config(**overrides) -> Gemma3TextConfig:
    return Gemma3TextConfig(**{
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
        "sliding_window": 12, "layer_types": GEMMA3_TYPES, "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 5.0,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
        **overrides})


def _norms_off_zero(model: torch.nn.Module) -> None:
    """transformers initialises Gemma's norm offsets to 0 (a weight of 1): give them values, so
    a norm loaded without its +1, or not at all, shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 0.3)


@dataclasses.dataclass
class Saved:
    hf: torch.nn.Module
    folder: Path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Saved]:
    out = {}
    for name, build in (("gemma", lambda: GemmaForCausalLM(gemma_config())),
                        ("gemma3", lambda: Gemma3ForCausalLM(gemma3_config()))):
        torch.manual_seed(0)
        hf = build().eval()
        _norms_off_zero(hf)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        out[name] = Saved(hf, folder)
    return out


@pytest.mark.parametrize("name", ["gemma", "gemma3"])
def test_family_matches_transformers(saved, name):
    model = saved[name]
    check_family(load_ours(model.folder), model.folder, hf_reference(model.hf), vocab=VOCAB)


def test_gemma3_triton_backend_matches_transformers(saved):
    model = saved["gemma3"]
    check_triton_backend(load_ours(model.folder), model.folder, hf_reference(model.hf),
                         vocab=VOCAB)


def test_model_layout(saved):
    """Norms hold 1 + the stored offset, the embedding scales by sqrt(hidden), the LM head is
    the embedding; Gemma 3's layers alternate window and RoPE table as layer_types says."""
    gemma = load_ours(saved["gemma"].folder)
    assert isinstance(gemma, OurGemma) and gemma.tie_word_embeddings
    hf_norm = saved["gemma"].hf.model.layers[1].post_attention_layernorm.weight
    torch.testing.assert_close(gemma.model.layers[1].post_attention_layernorm.weight, hf_norm + 1)
    assert isinstance(gemma.model.embed_tokens, ScaledEmbedding)
    assert gemma.model.embed_tokens.scale == 8.0

    gemma3 = load_ours(saved["gemma3"].folder)
    assert isinstance(gemma3, OurGemma3) and gemma3.sliding_window is None
    layers = gemma3.model.layers
    assert [layer.self_attn.layer_window for layer in layers] == [12, None, 12, None]
    assert [layer.local_rope for layer in layers] == [True, False, True, False]
    assert gemma3.model.rotary_emb.inv_freq[1] != gemma3.model.local_rotary_emb.inv_freq[1]
    assert layers[0].self_attn.scale == 24 ** -0.5
    hf_q_norm = saved["gemma3"].hf.model.layers[2].self_attn.q_norm.weight
    torch.testing.assert_close(layers[2].self_attn.q_norm.weight, hf_q_norm + 1)


@pytest.mark.parametrize("mutation", ["no window", "one rope table", "no logit cap"])
def test_gemma3_parity_checks_see_each_part(saved, mutation):
    """With one Gemma 3 part undone, our logits leave transformers' (so the checks above
    exercise the window, both RoPE tables and the soft-capping)."""
    model = saved["gemma3"]
    ours = load_ours(model.folder)
    if mutation == "no window":
        for layer in ours.model.layers:
            layer.self_attn.layer_window = None
    elif mutation == "one rope table":
        ours.model.local_rotary_emb = ours.model.rotary_emb
    else:
        ours.final_logit_softcap = None
    with pytest.raises(AssertionError, match="not close"):
        check_prefill_and_decode(ours, memoized(hf_reference(model.hf)), vocab=VOCAB,
                                 chunks=[40])


def test_gemma3_older_config_keys(saved, tmp_path):
    """Configs written before transformers 5 (the hub's Gemma 3 1B): `rope_theta` with
    `rope_scaling` for the full layers, `rope_local_base_freq` for the windowed ones,
    `sliding_window_pattern` in place of layer_types, read as the same model."""
    model = saved["gemma3"]
    folder = shutil.copytree(model.folder, tmp_path / "older")
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.pop("layer_types")
    config.update({"rope_theta": rope["full_attention"]["rope_theta"],
                   "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                   "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
                   "sliding_window_pattern": 2, "transformers_version": "4.50.0.dev0"})
    (folder / "config.json").write_text(json.dumps(config))
    ours = load_ours(folder)
    assert [layer.self_attn.layer_window for layer in ours.model.layers] == [12, None, 12, None]
    check_prefill_and_decode(ours, memoized(hf_reference(model.hf)), vocab=VOCAB, chunks=[40])


@pytest.mark.parametrize("field, value, match", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
])
def test_gemma3_unsupported_settings_name_the_field(field, value, match):
    config = gemma3_config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        OurGemma3(config)


def test_layer_window_needs_no_model_wide_window():
    """A layer's own window and a model-wide one cannot both apply (the metadata would mask
    with one and the kernels with the other)."""
    from ksana_llm.layers.attention import paged_attention

    q = torch.zeros(1, 1, 4)
    meta = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), sliding_window=8)
    with pytest.raises(ValueError, match="layer_window"):
        paged_attention(q, q, q, (torch.zeros(1, 4, 1, 4), torch.zeros(1, 4, 1, 4)), meta, 1.0,
                        layer_window=4)
