"""Cohere Command R / R+ (`CohereForCausalLM`) and Command R7B / A (`Cohere2ForCausalLM`) end to
end against transformers (fp32).

Tiny random models saved by transformers, norm weights drawn away from 1, a logit scale of 0.25:
logits at prefill (whole and chunked), at 16 decode steps and on a prefix-cache hit, and greedy
tokens through the Engine (tests/family_harness.py). Command R+'s kind with per-head q/k
LayerNorms, Command R's without; Cohere 2's windowed layer (8 tokens, outrun by the 40-token
prompts) rotates and its full layer takes no positions. Also through the Triton kernels (their
interpreter on CPU), and without the rotary reordering (the logits then leave transformers').
Tensor parallelism is in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM

from ksana_llm.models import interleaved_rope
from ksana_llm.models.cohere import Cohere2ForCausalLM as OurCohere2
from ksana_llm.models.cohere import CohereForCausalLM as OurCohere
from tests.family_harness import (TritonDriver, check_family, check_other_format,
                                  check_prefill_and_decode, hf_reference, load_ours, memoized,
                                  save_each, write_bin_twin)

VOCAB = 256
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, logit_scale=0.25)
MODELS = {
    "command-r-plus": lambda: CohereForCausalLM(CohereConfig(**SHAPE, use_qk_norm=True)),
    "command-r": lambda: CohereForCausalLM(CohereConfig(**SHAPE)),
    "command-r7b": lambda: Cohere2ForCausalLM(Cohere2Config(
        **SHAPE, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_each(tmp_path_factory, MODELS, qk_std=0.3)  # scores big enough for positions


@pytest.mark.parametrize("name", list(MODELS))
def test_family_matches_transformers(saved, name):
    hf, folder = saved[name]
    ours = load_ours(folder)
    assert isinstance(ours, OurCohere2 if name == "command-r7b" else OurCohere)
    if name == "command-r7b":
        assert ours.layer_sliding_window == 8
        assert [layer.rotates for layer in ours.model.layers] == [True, False]
    check_family(ours, folder, hf_reference(hf), vocab=VOCAB)


@pytest.mark.parametrize("name", ["command-r-plus", "command-r7b"])
def test_triton_kernels_match_transformers(saved, name):
    hf, folder = saved[name]
    check_prefill_and_decode(load_ours(folder), memoized(hf_reference(hf)), vocab=VOCAB,
                             chunks=[16, 16, 8], driver_class=TritonDriver)


def test_parity_needs_the_rotary_reordering(saved, monkeypatch):
    hf, folder = saved["command-r-plus"]
    monkeypatch.setattr(interleaved_rope, "halves_order",
                        lambda head_dim, rotary_dim: torch.arange(head_dim))
    with pytest.raises(AssertionError, match="not close"):
        check_prefill_and_decode(load_ours(folder), memoized(hf_reference(hf)), vocab=VOCAB,
                                 chunks=[40])


def test_pytorch_bin_loads_the_same(saved, tmp_path):
    hf, folder = saved["command-r-plus"]
    check_other_format(load_ours(folder), write_bin_twin(folder, tmp_path / "bin"),
                       memoized(hf_reference(hf)), vocab=VOCAB)
