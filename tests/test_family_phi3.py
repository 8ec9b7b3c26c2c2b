"""Phi-3 / Phi-4 (`Phi3ForCausalLM`) end to end against transformers (fp32).

Tiny random models saved by transformers, whose checkpoints hold the fused `qkv_proj` and
`gate_up_proj` tensors: one with Phi-3-mini-4k's kind of model-wide sliding window (12 tokens,
outrun by the 40-token test prompts), one without (Phi-4's): logits at prefill (whole and
chunked), at 16 decode steps and on a prefix-cache hit, and greedy tokens through the Engine
(tests/family_harness.py). Tensor parallelism (the fused tensors split into each rank's shard)
is in tests/test_tensor_parallel.py. LongRoPE configs and partial rotary factors are refused.
"""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("rope_parameters, match", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "rope_theta": 10000.0}, "longrope"),
    ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
     "partial_rotary_factor"),
])
def test_unsupported_rope_is_refused_by_name(saved, tmp_path, rope_parameters, match):
    _, folder = saved["full"]
    changed = shutil.copytree(folder, tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    config["rope_parameters"] = rope_parameters
    if match == "longrope":
        config["max_position_embeddings"] = 512  # LongRoPE extends the original 256
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_ours(changed)


def test_pytorch_bin_loads_the_same(saved, tmp_path):
    hf, folder = saved["windowed"]
    check_other_format(load_ours(folder), write_bin_twin(folder, tmp_path / "bin"),
                       memoized(hf_reference(hf)), vocab=VOCAB)
