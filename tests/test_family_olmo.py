"""AllenAI OLMo 2 (`Olmo2ForCausalLM`) and OLMo 3 (`Olmo3ForCausalLM`) end to end against
transformers (fp32).

Tiny random models saved by transformers, their norm weights drawn away from 1 (a norm over each
head instead of the whole projection, or one left out, moves every logit): logits at prefill
(whole and chunked), at 16 decode steps and on a prefix-cache hit, and greedy tokens through the
Engine (tests/family_harness.py). OLMo 3's: a windowed layer (8 tokens, outrun by the 40-token
prompts) and a full one, each kind with its own RoPE base; also through the Triton kernels (their
interpreter on CPU). Tensor parallelism (q/k norms summed over ranks, KV heads split or
replicated) and pipeline parallelism are in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM

from ksana_llm.layers.norm import ShardedRMSNorm
from ksana_llm.models.olmo2 import Olmo2ForCausalLM as OurOlmo2
from ksana_llm.models.olmo2 import Olmo3ForCausalLM as OurOlmo3
from tests.family_harness import (check_family, check_other_format, check_prefill_and_decode,
                                  check_triton_backend, hf_reference, load_ours, memoized,
                                  save_each, write_bin_twin)

VOCAB = 256
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
MODELS = {
    "olmo2": lambda: Olmo2ForCausalLM(Olmo2Config(**SHAPE)),
    "olmo3": lambda: Olmo3ForCausalLM(Olmo3Config(
        **SHAPE, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 500000.0}})),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_each(tmp_path_factory, MODELS)


@pytest.mark.parametrize("name", list(MODELS))
def test_family_matches_transformers(saved, name):
    hf, folder = saved[name]
    ours = load_ours(folder)
    assert isinstance(ours, OurOlmo3 if name == "olmo3" else OurOlmo2)
    assert isinstance(ours.model.layers[0].self_attn.q_norm, ShardedRMSNorm)
    if name == "olmo3":
        assert ours.layer_sliding_window == 8 and ours.sliding_window is None
        assert [layer.self_attn.layer_window for layer in ours.model.layers] == [8, None]
    check_family(ours, folder, hf_reference(hf), vocab=VOCAB)


def test_norms_multiply_their_weight_in_float32(saved):
    """transformers' OLMo 2 / 3 norms multiply the weight before the cast back (bfloat16 rounds
    the two orders differently: tests/test_family_gpt_oss.py proves the multiply itself)."""
    from ksana_llm.layers.norm import RMSNorm

    for name in MODELS:
        ours = load_ours(saved[name][1])
        norms = [m for m in ours.modules() if isinstance(m, RMSNorm)]
        assert norms and all(norm.weight_in_float32 for norm in norms)


def test_olmo3_through_the_triton_kernels(saved):
    hf, folder = saved["olmo3"]
    check_triton_backend(load_ours(folder), folder, memoized(hf_reference(hf)), vocab=VOCAB)


def test_pytorch_bin_loads_the_same(saved, tmp_path):
    hf, folder = saved["olmo2"]
    check_other_format(load_ours(folder), write_bin_twin(folder, tmp_path / "bin"),
                       memoized(hf_reference(hf)), vocab=VOCAB)


def test_norms_over_whole_projections_matter(saved):
    """The same weights normalised per head (Qwen3's way) leave transformers' logits."""
    hf, folder = saved["olmo2"]
    ours = load_ours(folder)
    for layer in ours.model.layers:
        attn = layer.self_attn
        attn.norms_whole_projections = False
        per_head = {"q_norm": attn.q_norm.weight[:attn.head_dim],
                    "k_norm": attn.k_norm.weight[:attn.head_dim]}
        attn.qk_norm = True
        for name, weight in per_head.items():
            norm = torch.nn.RMSNorm(attn.head_dim, eps=1e-6)
            norm.weight.data.copy_(weight)
            norm.eps = 1e-6
            setattr(attn, name, norm)
    with pytest.raises(AssertionError, match="not close"):
        check_prefill_and_decode(ours, memoized(hf_reference(hf)), vocab=VOCAB, chunks=[40])


def test_norm_weight_of_the_wrong_size_names_it(saved, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, folder = saved["olmo2"]
    broken = shutil.copytree(folder, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.self_attn.k_norm.weight"
    tensors[name] = tensors[name][:16]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_ours(broken)
