"""GLM-4 (`GlmForCausalLM`) and GLM-4-0414 (`Glm4ForCausalLM`) end to end against transformers
(fp32).

Tiny random models saved by transformers: RoPE on half of each head in interleaved pairs, q/k/v
biases (given values), a fused `gate_up_proj`, and for GLM-4-0414 the norms after attention and
after the MLP (given values off 1). Logits at prefill (whole and chunked), at 16 decode steps and
on a prefix-cache hit, and greedy tokens through the Engine (tests/family_harness.py); GLM-4-0414
also through the Triton kernels. Without the load-time reordering of the rotary rows the logits
leave transformers'. Tensor parallelism is in tests/test_tensor_parallel.py, GPTQ / AWQ / FP8
checkpoints in tests/test_gptq_awq_checkpoints.py and tests/test_quantized_checkpoints.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4Config, Glm4ForCausalLM, GlmConfig, GlmForCausalLM

from ksana_llm.models import interleaved_rope
from tests.family_harness import (TritonDriver, check_family, check_other_format,
                                  check_prefill_and_decode, hf_reference, load_ours, memoized,
                                  write_bin_twin)
from tests.tiny_models import perturb_biases_and_norms

VOCAB = 256
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for name, build in (("glm", lambda: GlmForCausalLM(GlmConfig(**COMMON))),
                        ("glm4", lambda: Glm4ForCausalLM(Glm4Config(**COMMON)))):
        torch.manual_seed(0)
        hf = build().eval()
        perturb_biases_and_norms(hf)
        with torch.no_grad():
            for param_name, param in hf.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.normal_(1, 0.2)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        out[name] = (hf, folder)
    return out


@pytest.mark.parametrize("name", ["glm", "glm4"])
def test_family_matches_transformers(saved, name):
    hf, folder = saved[name]
    ours = load_ours(folder)
    assert type(ours).__name__ == type(hf).__name__
    assert ours.model.rotary_emb.inv_freq.numel() == 4  # rotary dim 8 of the 16-dim heads
    check_family(ours, folder, hf_reference(hf), vocab=VOCAB)


def test_glm4_triton_kernels_match_transformers(saved):
    hf, folder = saved["glm4"]
    check_prefill_and_decode(load_ours(folder), memoized(hf_reference(hf)), vocab=VOCAB,
                             chunks=[16, 16, 8], driver_class=TritonDriver)


def test_parity_needs_the_rotary_reordering(saved, monkeypatch):
    """With the rotary rows loaded as stored (interleaved pairs rotated as halves), the logits
    leave transformers': the reordering is what the parity above rests on."""
    hf, folder = saved["glm"]
    monkeypatch.setattr(interleaved_rope, "halves_order", lambda head_dim, rotary_dim: torch.arange(head_dim))
    with pytest.raises(AssertionError, match="not close"):
        check_prefill_and_decode(load_ours(folder), memoized(hf_reference(hf)), vocab=VOCAB,
                                 chunks=[40])


def test_halves_order():
    assert interleaved_rope.halves_order(8, 4).tolist() == [0, 2, 1, 3, 4, 5, 6, 7]


def test_pytorch_bin_loads_the_same(saved, tmp_path):
    hf, folder = saved["glm4"]
    check_other_format(load_ours(folder), write_bin_twin(folder, tmp_path / "bin"),
                       memoized(hf_reference(hf)), vocab=VOCAB)
