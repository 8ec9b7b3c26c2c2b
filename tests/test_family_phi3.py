"""Phi-3 / Phi-4 (`Phi3ForCausalLM`) end to end against transformers (fp32).

Tiny random models saved by transformers, whose checkpoints hold the fused `qkv_proj` and
`gate_up_proj` tensors: one with Phi-3-mini-4k's kind of model-wide sliding window (12 tokens,
outrun by the 40-token test prompts), one without (Phi-4's): logits at prefill (whole and
chunked), at 16 decode steps and on a prefix-cache hit, and greedy tokens through the Engine
(tests/family_harness.py). Tensor parallelism (the fused tensors split into each rank's shard)
is in tests/test_tensor_parallel.py; LongRoPE and partial rotary factors in
tests/test_family_phi3_longrope.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Phi3Config, Phi3ForCausalLM

from ksana_llm.models.phi3 import Phi3ForCausalLM as OurPhi3
from tests.family_harness import (check_family, check_other_format, hf_reference, load_ours,
                                  memoized, write_bin_twin)

VOCAB = 256


def phi3_config(**overrides) -> Phi3Config:
    return Phi3Config(**{
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "original_max_position_embeddings": 256,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
        **overrides})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for name, window in (("windowed", 12), ("full", None)):
        torch.manual_seed(0)
        hf = Phi3ForCausalLM(phi3_config(sliding_window=window)).eval()
        folder = tmp_path_factory.mktemp(f"phi3_{name}")
        hf.save_pretrained(folder)
        out[name] = (hf, folder)
    return out


@pytest.mark.parametrize("name", ["windowed", "full"])
def test_family_matches_transformers(saved, name):
    hf, folder = saved[name]
    names = list(load_file(folder / "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    ours = load_ours(folder)
    assert isinstance(ours, OurPhi3)
    assert ours.sliding_window == (12 if name == "windowed" else None)
    check_family(ours, folder, hf_reference(hf), vocab=VOCAB)


def test_fused_tensor_of_the_wrong_size_names_it(saved, tmp_path):
    _, folder = saved["full"]
    broken = shutil.copytree(folder, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-8]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_ours(broken)


def test_pytorch_bin_loads_the_same(saved, tmp_path):
    hf, folder = saved["windowed"]
    check_other_format(load_ours(folder), write_bin_twin(folder, tmp_path / "bin"),
                       memoized(hf_reference(hf)), vocab=VOCAB)
