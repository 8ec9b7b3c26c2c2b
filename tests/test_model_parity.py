"""Logits of our Llama-family implementation vs transformers (fp32), through the paged KV cache:
prefill (whole and chunked), 16 decode steps, a prefix-cache hit, and a mixed batch."""

from __future__ import annotations

import pytest
import torch

from ksana_llm.api.model import Model
from tests.family_harness import (ATOL, PagedDriver, check_prefill_and_decode,
                                  check_prefix_hit_mixed_batch, greedy_trace, hf_reference)
from tests.tiny_models import TINY_CONFIGS, build_tiny_model


def hf_greedy_trace(hf: torch.nn.Module, prompt: list[int], steps: int):
    return greedy_trace(hf_reference(hf), prompt, steps)


def load_ours(hf_model: torch.nn.Module, folder) -> torch.nn.Module:
    return Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False).module


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_model(request.param, folder)
    return request.param, hf, load_ours(hf, folder)


@pytest.mark.parametrize("chunks", [[40], [16, 16, 8], [1, 39]])
def test_prefill_and_decode_logits_match(tiny, chunks):
    name, hf, ours = tiny
    check_prefill_and_decode(ours, hf_reference(hf), vocab=256, chunks=chunks)


def test_prefix_cache_hit_and_mixed_batch_logits_match(tiny):
    """One decode, one prefix-hit prefill (24 shared tokens = 6 full blocks) and one chunked
    prefill in one batch, then all decode together at different context lengths."""
    name, hf, ours = tiny
    check_prefix_hit_mixed_batch(ours, hf_reference(hf), vocab=256)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_loads_and_tracks_fp32(tmp_path, dtype):
    hf = build_tiny_model("llama2", tmp_path)
    ours = Model.from_pretrained(tmp_path, device="cpu", dtype=dtype, progress=False)
    assert {p.dtype for p in ours.module.parameters()} == {getattr(torch, dtype)}
    torch.manual_seed(3)
    prompt = torch.randint(3, 256, (20,)).tolist()
    ids, ref = hf_greedy_trace(hf, prompt, 4)
    driver = PagedDriver(ours.module, dtype=getattr(torch, dtype))
    seq = driver.new_seq(prompt)
    logits = driver.step([(seq, len(prompt))])
    torch.testing.assert_close(logits[0], ref[len(prompt) - 1], atol=0.1, rtol=0.05)
    for i in range(4):
        seq.output_token_ids.append(ids[len(prompt) + i])
        logits = driver.step([(seq, 1)])
        torch.testing.assert_close(logits[0], ref[len(prompt) + i], atol=0.1, rtol=0.05)


def test_many_decodes_split_into_length_groups_match(tmp_path):
    """20 sequences of very different lengths decode in one step: several padded groups."""
    hf = build_tiny_model("llama2", tmp_path)
    ours = load_ours(hf, tmp_path)
    torch.manual_seed(4)
    lengths = [3 + 6 * i for i in range(20)]
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in lengths]
    traces = [hf_greedy_trace(hf, p, 3) for p in prompts]
    driver = PagedDriver(ours, num_blocks=512)
    seqs = [driver.new_seq(p, f"s{i}") for i, p in enumerate(prompts)]
    driver.step([(s, s.num_prompt_tokens) for s in seqs])
    groups = driver.runner._decode_groups(sorted(s.num_tokens for s in seqs))
    assert len(groups) > 1
    for _ in range(3):
        for seq, (ids, _) in zip(seqs, traces):
            seq.output_token_ids.append(ids[seq.num_tokens])
        logits = driver.step([(s, 1) for s in seqs])
        for row, (seq, (_, ref)) in enumerate(zip(seqs, traces)):
            torch.testing.assert_close(logits[row], ref[seq.num_tokens - 1], atol=ATOL, rtol=1e-4)


def test_decode_groups_bound_padding():
    from ksana_llm.runner.model_runner import ModelRunner

    groups = ModelRunner._decode_groups(list(range(0, 400, 10)), max_waste=1.5, min_size=8)
    covered = [i for first, count in groups for i in range(first, first + count)]
    assert covered == list(range(40)) and len(groups) > 1
    assert all(count >= 8 for _, count in groups)
    assert ModelRunner._decode_groups([5] * 30) == [(0, 30)]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_engine_greedy_tokens_match_from_bin_checkpoint(tmp_path, name):
    """32 greedy tokens through the Engine (chunked prefill, then a prefix-cache hit) equal
    transformers', for every Llama-family config loaded from a pytorch_model.bin folder."""
    from tests.family_harness import check_engine_greedy, save_both_formats

    hf = build_tiny_model(name, tmp_path / "hf")
    folders = save_both_formats(hf, tmp_path)
    check_engine_greedy(folders["bin"], hf_reference(hf), vocab=256)


def _retie(folder, head: torch.Tensor | None) -> None:
    """Rewrite `folder`'s config to tie_word_embeddings=true, and store `head` as lm_head.weight
    (None: keep the stored one)."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    if head is not None:
        tensors = load_file(folder / "model.safetensors")
        save_file({**tensors, "lm_head.weight": head.clone()}, folder / "model.safetensors",
                  metadata={"format": "pt"})


def test_tied_config_with_a_different_stored_head_unties_as_transformers(tmp_path):
    """transformers uses a stored LM head that differs from the embedding, whatever the config
    says; one equal to it (as .bin files store) leaves the model tied."""
    from transformers import AutoModelForCausalLM

    build_tiny_model("llama2", tmp_path / "untied")
    _retie(tmp_path / "untied", None)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "untied", dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    ours = load_ours(hf, tmp_path / "untied")
    assert not ours.tie_word_embeddings
    check_prefill_and_decode(ours, hf_reference(hf), vocab=256)

    tied = build_tiny_model("smollm-tied-mha", tmp_path / "tied")
    _retie(tmp_path / "tied", tied.model.embed_tokens.weight.detach())
    ours = load_ours(tied, tmp_path / "tied")
    assert ours.tie_word_embeddings and not hasattr(ours, "lm_head")
    check_prefill_and_decode(ours, hf_reference(tied), vocab=256)


def test_tied_config_storing_only_the_head_loads_as_transformers(tmp_path):
    """transformers ties the two either way: a tied checkpoint may store lm_head.weight alone."""
    from safetensors.torch import load_file, save_file

    tied = build_tiny_model("smollm-tied-mha", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_ours(tied, tmp_path)
    assert ours.tie_word_embeddings and not hasattr(ours, "lm_head")
    check_prefill_and_decode(ours, hf_reference(tied), vocab=256)


@pytest.mark.parametrize("name", ["smollm-tied-mha", "qwen3"])
def test_a_base_models_checkpoint_loads(tmp_path, name, caplog):
    """Saved from the base model (Qwen3-Embedding's layout: "embed_tokens.weight",
    "layers.0. ...", no "model." prefix and no LM head), as transformers loads it. Untied, the
    head is the embedding (said in a warning): hidden states are the model's either way."""
    from safetensors.torch import load_file, save_file

    hf = build_tiny_model(name, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    base = {key.removeprefix("model."): value for key, value in tensors.items()
            if key.startswith("model.")}
    save_file(base, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="ksana_llm.model"):
        ours = load_ours(hf, tmp_path)
    if not hf.config.tie_word_embeddings:
        assert "a base model's (no LM head)" in caplog.text
        assert torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)
        hf.lm_head.weight.data.copy_(hf.model.embed_tokens.weight)
    check_prefill_and_decode(ours, hf_reference(hf), vocab=256)
