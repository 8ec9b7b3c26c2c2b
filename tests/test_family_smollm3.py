"""SmolLM3 (`SmolLM3ForCausalLM`) end to end against transformers (fp32).

Tiny random models saved by transformers with a NoPE layer every second layer (SmolLM3-3B has
one in four): one as released (no window), one with `use_sliding_window`, which windows the NoPE
layers (12 tokens, outrun by the 40-token test prompts). Logits at prefill (whole and chunked),
at 16 decode steps and on a prefix-cache hit, and greedy tokens through the Engine
(tests/family_harness.py), and through the Triton kernels (the NoPE layers store K/V
themselves, the RoPE kernel not running for them). With RoPE on every layer the logits leave
transformers'.
"""

from __future__ import annotations

import pytest
import torch
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from ksana_llm.models.llama import LlamaDecoderLayer
from ksana_llm.models.smollm3 import NoPEDecoderLayer
from tests.family_harness import (TritonDriver, check_family, check_other_format,
                                  check_prefill_and_decode, hf_reference, load_ours, memoized,
                                  write_bin_twin)

VOCAB = 256


def smollm3_config(**overrides) -> SmolLM3Config:
    return SmolLM3Config(**{
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "no_rope_layer_interval": 2, **overrides})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for name, extra in (("released", {}),
                        ("windowed", {"use_sliding_window": True, "sliding_window": 12})):
        torch.manual_seed(0)
        hf = SmolLM3ForCausalLM(smollm3_config(**extra)).eval()
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        out[name] = (hf, folder)
    return out


@pytest.mark.parametrize("name", ["released", "windowed"])
def test_family_matches_transformers(saved, name):
    hf, folder = saved[name]
    ours = load_ours(folder)
    assert [type(layer) for layer in ours.model.layers] == [LlamaDecoderLayer, NoPEDecoderLayer] * 2
    windows = [layer.self_attn.layer_window for layer in ours.model.layers]
    assert windows == ([None, 12] * 2 if name == "windowed" else [None] * 4)
    check_family(ours, folder, hf_reference(hf), vocab=VOCAB)


def test_triton_kernels_match_transformers(saved):
    hf, folder = saved["released"]
    check_prefill_and_decode(load_ours(folder), memoized(hf_reference(hf)), vocab=VOCAB,
                             chunks=[16, 16, 8], driver_class=TritonDriver)


def test_parity_needs_the_nope_layers(saved, monkeypatch):
    hf, folder = saved["released"]
    monkeypatch.setattr(NoPEDecoderLayer, "forward", LlamaDecoderLayer.forward)
    with pytest.raises(AssertionError, match="not close"):
        check_prefill_and_decode(load_ours(folder), memoized(hf_reference(hf)), vocab=VOCAB,
                                 chunks=[40])


def test_no_rope_layers_of_the_wrong_length_are_refused():
    from ksana_llm.models.smollm3 import SmolLM3ForCausalLM as Ours

    config = smollm3_config()
    config.no_rope_layers = [1, 0]
    with pytest.raises(ValueError, match="no_rope_layers must have 4 entries"):
        Ours(config)


def test_pytorch_bin_loads_the_same(saved, tmp_path):
    hf, folder = saved["released"]
    check_other_format(load_ours(folder), write_bin_twin(folder, tmp_path / "bin"),
                       memoized(hf_reference(hf)), vocab=VOCAB)
