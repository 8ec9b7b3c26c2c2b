"""BigCode StarCoder 2 (`Starcoder2ForCausalLM`) end to end against transformers (fp32).

Tiny random models saved by transformers, LayerNorm weights and every bias drawn away from their
defaults (a lost bias or a norm taken for an RMSNorm moves every logit): the 3B / 7B kind with a
model-wide window (12 tokens, outrun by the 40-token prompts) and the 15B's without; logits at
prefill (whole and chunked), at 16 decode steps and on a prefix-cache hit, and greedy tokens
through the Engine (tests/family_harness.py). Tensor parallelism (`c_fc` by columns, `c_proj`
by rows, its bias added once) is in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Starcoder2Config, Starcoder2ForCausalLM

from ksana_llm.models.starcoder2 import Starcoder2ForCausalLM as OurStarcoder2
from tests.family_harness import (check_family, check_other_format, hf_reference, load_ours,
                                  memoized, spread_weights, write_bin_twin)

VOCAB = 256


def build_starcoder2(folder, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = spread_weights(Starcoder2ForCausalLM(Starcoder2Config(**{
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, **overrides})), norm_std=0.3)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {name: (build_starcoder2(folder := tmp_path_factory.mktemp(name),
                                    sliding_window=window), folder)
            for name, window in (("windowed", 12), ("full", None))}


@pytest.mark.parametrize("name", ["windowed", "full"])
def test_family_matches_transformers(saved, name):
    hf, folder = saved[name]
    ours = load_ours(folder)
    assert isinstance(ours, OurStarcoder2)
    assert ours.sliding_window == (12 if name == "windowed" else None)
    check_family(ours, folder, hf_reference(hf), vocab=VOCAB)


def test_pytorch_bin_loads_the_same(saved, tmp_path):
    hf, folder = saved["full"]
    check_other_format(load_ours(folder), write_bin_twin(folder, tmp_path / "bin"),
                       memoized(hf_reference(hf)), vocab=VOCAB)
