"""Gemma (1), Gemma 2 and Gemma 3 (text) end to end against transformers (fp32).

Tiny random models saved by transformers, their norm weights moved off 0 (Gemma stores them as
offsets from 1): `GemmaForCausalLM` (MQA: one KV head, tied embeddings); `Gemma2ForCausalLM`
(windowed and full layers, a 12-token window that the 40-token test prompts outrun, attention
logits soft-capped at 1.0 with attention weights large enough for the cap to bite,
query_pre_attn_scalar, final logit soft-capping); `Gemma3ForCausalLM` (the same windows, each
kind of layer with its own RoPE, q/k norms, no attention cap). Logits at prefill (whole and
chunked), at 16 decode steps and on a prefix-cache hit, and greedy tokens through the Engine
(tests/family_harness.py); Gemma 2 and 3 also on the Triton kernels. The parts a reference
check might pass by luck are undone one at a time and must fail.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3Config, Gemma3ForCausalLM,
                          Gemma3ForConditionalGeneration, Gemma3TextConfig, GemmaConfig,
                          GemmaForCausalLM, SiglipVisionConfig)

from ksana_llm.layers.attention import AttentionMetadata
from ksana_llm.models.gemma import Gemma2ForCausalLM as OurGemma2
from ksana_llm.models.gemma import Gemma3ForCausalLM as OurGemma3
from ksana_llm.models.gemma import GemmaForCausalLM as OurGemma
from ksana_llm.models.gemma import ScaledEmbedding
from tests.family_harness import (TritonDriver, check_family, check_other_format,
                                  check_prefill_and_decode, check_triton_backend, hf_reference,
                                  load_ours, memoized, write_bin_twin)

VOCAB = 256
GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


# What every tiny Gemma here shares; each config adds its family's own keys.
SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "head_dim": 32,
         "vocab_size": VOCAB, "max_position_embeddings": 256, "bos_token_id": 2,
         "eos_token_id": 1, "pad_token_id": 0}
# Gemma 2 / 3: 4 layers, windowed and full alternating with a 12-token window.
WINDOWED = {**SHAPE, "num_hidden_layers": 4, "num_key_value_heads": 2, "sliding_window": 12,
            "query_pre_attn_scalar": 24, "final_logit_softcapping": 5.0}


def gemma_config(**overrides) -> GemmaConfig:
    return GemmaConfig(**{**SHAPE, "num_hidden_layers": 2, "num_key_value_heads": 1,
                          **overrides})


def gemma2_config(**overrides) -> Gemma2Config:
    return Gemma2Config(**{**WINDOWED, "attn_logit_softcapping": 1.0, **overrides})


def gemma3_config(**overrides) -> Gemma3TextConfig:
    return Gemma3TextConfig(**{
        **WINDOWED, "layer_types": GEMMA3_TYPES,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
        **overrides})


def _randomize(model: torch.nn.Module) -> None:
    """transformers initialises Gemma's norm offsets to 0 (a weight of 1): give them values, so
    a norm loaded without its +1, or not at all, shows. Attention projections get weights large
    enough that Gemma 2's logit cap changes the scores."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 0.3)
            elif ".self_attn." in name and name.endswith("proj.weight"):
                param.normal_(0, 0.2)


@dataclasses.dataclass
class Saved:
    hf: torch.nn.Module
    folder: Path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Saved]:
    out = {}
    for name, build in (("gemma", lambda: GemmaForCausalLM(gemma_config())),
                        ("gemma2", lambda: Gemma2ForCausalLM(gemma2_config())),
                        ("gemma3", lambda: Gemma3ForCausalLM(gemma3_config()))):
        torch.manual_seed(0)
        hf = build().eval()
        _randomize(hf)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        out[name] = Saved(hf, folder)
    return out


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_family_matches_transformers(saved, name):
    model = saved[name]
    check_family(load_ours(model.folder), model.folder, hf_reference(model.hf), vocab=VOCAB)


def test_gemma3_triton_backend_matches_transformers(saved):
    model = saved["gemma3"]
    check_triton_backend(load_ours(model.folder), model.folder, hf_reference(model.hf),
                         vocab=VOCAB)


def test_gemma2_triton_kernels_match_transformers(saved):
    """The soft-capped attention in the Triton kernels (windowed and full layers): logits over
    a chunked prefill and 16 decode steps."""
    model = saved["gemma2"]
    check_prefill_and_decode(load_ours(model.folder), memoized(hf_reference(model.hf)),
                             vocab=VOCAB, chunks=[16, 16, 8], driver_class=TritonDriver)


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
    assert {layer.self_attn.softcap for layer in layers} == {None}

    gemma2 = load_ours(saved["gemma2"].folder)
    assert isinstance(gemma2, OurGemma2) and gemma2.model.local_rotary_emb is None
    layers = gemma2.model.layers
    assert [layer.self_attn.layer_window for layer in layers] == [12, None, 12, None]
    assert {layer.self_attn.softcap for layer in layers} == {1.0}
    assert not layers[0].self_attn.qk_norm and gemma2.final_logit_softcap == 5.0


@pytest.mark.parametrize("name, mutation", [
    ("gemma3", "no window"), ("gemma3", "one rope table"), ("gemma3", "no logit cap"),
    ("gemma2", "no window"), ("gemma2", "no attention cap")])
def test_parity_checks_see_each_part(saved, name, mutation):
    """With one part undone, our logits leave transformers' (so the checks above exercise the
    windows, both RoPE tables, and both soft-cappings)."""
    model = saved[name]
    ours = load_ours(model.folder)
    if mutation == "no window":
        for layer in ours.model.layers:
            layer.self_attn.layer_window = None
    elif mutation == "no attention cap":
        for layer in ours.model.layers:
            layer.self_attn.softcap = None
    elif mutation == "one rope table":
        ours.model.local_rotary_emb = ours.model.rotary_emb
    else:
        ours.final_logit_softcap = None
    with pytest.raises(AssertionError, match="not close"):
        check_prefill_and_decode(ours, memoized(hf_reference(model.hf)), vocab=VOCAB,
                                 chunks=[40])


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """A `Gemma3ForConditionalGeneration` checkpoint (Gemma 3 4B-27B; here tiny, with a
    one-layer SigLIP tower) as transformers saves it (`language_model.model.*`,
    `vision_tower.*`, `multi_modal_projector.*`): served as its language model, equal to
    transformers' model on text, with no vision weight loaded."""
    text = gemma3_config(vocab_size=VOCAB + 4, final_logit_softcapping=None)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=VOCAB, eoi_token_index=VOCAB + 1,
                          image_token_index=VOCAB + 2)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    ours = load_ours(tmp_path)
    assert isinstance(ours, OurGemma3)
    assert not any("vision" in name or "projector" in name for name, _ in ours.named_parameters())

    def reference(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(input_ids=torch.tensor([ids])).logits[0].float()

    check_family(ours, tmp_path, reference, vocab=VOCAB)


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


@pytest.mark.parametrize("cls, config, field, value", [
    (OurGemma3, gemma3_config, "attn_logit_softcapping", 50.0),
    (OurGemma3, gemma3_config, "use_bidirectional_attention", True),
    (OurGemma2, gemma2_config, "layer_types", ["sliding_attention"]),
])
def test_unsupported_settings_name_the_field(cls, config, field, value):
    config = config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        cls(config)


def test_layer_window_needs_no_model_wide_window():
    """A layer's own window and a model-wide one cannot both apply (the metadata would mask
    with one and the kernels with the other)."""
    from ksana_llm.layers.attention import paged_attention

    q = torch.zeros(1, 1, 4)
    meta = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), sliding_window=8)
    with pytest.raises(ValueError, match="layer_window"):
        paged_attention(q, q, q, (torch.zeros(1, 4, 1, 4), torch.zeros(1, 4, 1, 4)), meta, 1.0,
                        layer_window=4)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_pytorch_bin_loads_the_same(saved, tmp_path, name):
    """Norm offsets, scaled embeddings and windows read from pytorch_model.bin as well."""
    model = saved[name]
    check_other_format(load_ours(model.folder), write_bin_twin(model.folder, tmp_path / "bin"),
                       memoized(hf_reference(model.hf)), vocab=VOCAB)
