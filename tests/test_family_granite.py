"""IBM Granite 3.x dense (`GraniteForCausalLM`) end to end against transformers (fp32).

A tiny random model with Granite-like multipliers (embeddings x12, softmax scale 1/16, residual
branches x0.22, logits / 8), saved by transformers: logits at prefill (whole and chunked), at 16
decode steps and on a prefix-cache hit, and greedy tokens through the Engine
(tests/family_harness.py); each multiplier left out makes the logits leave transformers';
prompt embeddings are scaled like token embeddings (as transformers scales `inputs_embeds`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GraniteConfig, GraniteForCausalLM

import ksana_llm as kt
from tests.family_harness import (check_family, check_other_format, check_prefill_and_decode,
                                  greedy_trace, hf_reference, load_ours, memoized,
                                  write_bin_twin)

VOCAB = 256


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    hf = GraniteForCausalLM(GraniteConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, embedding_multiplier=12.0, attention_multiplier=0.0625,
        residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True)).eval()
    with torch.no_grad():  # scores large enough for the softmax scale to matter
        for name, param in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("granite")
    hf.save_pretrained(folder)
    return hf, folder


def test_family_matches_transformers(saved):
    hf, folder = saved
    check_family(load_ours(folder), folder, hf_reference(hf), vocab=VOCAB)


def test_pytorch_bin_loads_the_same(saved, tmp_path):
    hf, folder = saved
    check_other_format(load_ours(folder), write_bin_twin(folder, tmp_path / "bin"),
                       memoized(hf_reference(hf)), vocab=VOCAB)


@pytest.mark.parametrize("multiplier", ["embedding", "attention", "residual", "logits"])
def test_each_multiplier_matters(saved, multiplier):
    hf, folder = saved
    ours = load_ours(folder)
    if multiplier == "embedding":
        ours.model.embedding_multiplier = None
    elif multiplier == "logits":
        ours.logits_scaling = 1.0
    for layer in ours.model.layers:
        if multiplier == "attention":
            layer.self_attn.scale = layer.self_attn.head_dim ** -0.5
        elif multiplier == "residual":
            layer.residual_multiplier = 1.0
    with pytest.raises(AssertionError, match="not close"):
        check_prefill_and_decode(ours, memoized(hf_reference(hf)), vocab=VOCAB, chunks=[40])


def test_prompt_embeds_are_scaled_like_tokens(saved):
    """transformers multiplies `inputs_embeds` by embedding_multiplier too: the rows of the
    embedding table, given as prompt_embeds, give the token prompt's continuation."""
    hf, folder = saved
    prompt = list(range(5, 25))
    expected, _ = greedy_trace(hf_reference(hf), prompt, 8)
    rows = hf.get_input_embeddings().weight[prompt].detach()
    config = kt.GenerationConfig(max_new_tokens=8, ignore_eos=True)
    with kt.Engine(str(folder), device="cpu", dtype="float32", num_device_blocks=32,
                   block_token_num=4) as engine:
        outs = engine.generate_outputs([prompt, {"prompt_embeds": rows}], config,
                                       use_tqdm=False)
    assert [o.token_ids for o in outs] == [expected[len(prompt):]] * 2
