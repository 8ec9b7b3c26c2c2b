"""GGUF files written here with gguf.GGUFWriter (tests/gguf_builder.py), loaded by our engine:
RoPE scaling the file states (Llama 3's `rope_freqs.weight`, linear / YaRN metadata) reaches the
converted config, the conversion cache notices a changed file of the same size and mtime, and
tokenizer files beside the GGUF do not replace its own. Logits are compared with a transformers
model built from gguf-py's dequantize of the same tensors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoTokenizer, LlamaForCausalLM

import ksana_llm as kt
from ksana_llm.api.forward_outputs import ForwardTarget
from ksana_llm.loader import convert_gguf_to_hf, gguf_cache_path
from ksana_llm.loader.gguf_rope import llama3_rope_factors
from tests.gguf_builder import HD, build, reference_model

THETA = 500000.0
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KSANA_LLM_CACHE", str(tmp_path / "cache"))


def _logits(path, ids: list[int]) -> torch.Tensor:
    with kt.Engine(str(path), device="cpu", dtype="float32", num_device_blocks=64) as engine:
        return engine.forward(ids, [ForwardTarget("logits")]).targets[0].tensor


def test_a_qwen3_file_keeps_its_head_dim(tmp_path):
    """Qwen3's head_dim is stated (attention.key_length), not hidden / heads; transformers'
    GGUF reader left Qwen3's default (128) instead, so a file with any other failed to load,
    blamed on corruption."""
    path = tmp_path / "qwen3.gguf"
    stored, vocab_size = build(path, arch="qwen3", qtype=T.Q8_0, tied=False, rope_theta=THETA)
    reference = reference_model(stored, vocab_size, "qwen3", False, THETA, 1e-5)
    assert reference.config.head_dim == HD != 128
    ids = [5, 17, 42, 7, 99, 3, 64, 12]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(path, ids), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_file_whose_heads_are_not_hidden_over_heads_loads(tmp_path, arch):
    """attention.key_length other than hidden / heads (Mistral-Nemo's shape): Qwen2's config
    has no head_dim attribute, which once left the stated size unread."""
    path = tmp_path / f"{arch}.gguf"
    stored, vocab_size = build(path, arch=arch, qtype=T.Q8_0, tied=False, rope_theta=THETA,
                               head_dim=32)
    reference = reference_model(stored, vocab_size, arch, False, THETA, 1e-5, head_dim=32)
    ids = [5, 17, 42, 7, 99, 3, 64, 12]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(path, ids), expected, atol=2e-4, rtol=1e-4)


def test_a_file_missing_tensors_or_split_in_parts_is_refused(tmp_path):
    """transformers makes up the tensors a file lacks (and says so only in its log): a file
    missing one, or one part of a split model, would serve random weights."""
    missing = tmp_path / "missing.gguf"
    build(missing, skip=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match="missing.gguf is missing 1 of the model's tensors, "
                                         "e.g. \\['model.layers.1.mlp.down_proj.weight'\\]"):
        kt.Model.from_pretrained(str(missing), device="cpu", progress=False)
    part = tmp_path / "m-00001-of-00002.gguf"
    build(part, extra=lambda writer: (writer.add_uint16("split.no", 0),
                                      writer.add_uint16("split.count", 2)))
    with pytest.raises(ValueError, match="one of 2 parts of a split GGUF model"):
        kt.Model.from_pretrained(str(part), device="cpu", progress=False)


def test_a_file_whose_tokenizer_cannot_be_built_serves_token_ids(tmp_path, caplog):
    """Tokenizer metadata transformers cannot read (an EOS id past the vocabulary) is a
    warning naming the file: the weights load, and serve token ids (skip_tokenizer_init)."""
    path = tmp_path / "bad-tokenizer.gguf"
    stored, vocab_size = build(path, qtype=T.Q8_0, rope_theta=THETA, eos_token_id=10**6)
    with caplog.at_level("WARNING", logger="ksana_llm.loader"):
        convert_gguf_to_hf(path)
    assert f"{path}: its tokenizer cannot be read" in caplog.text
    reference = reference_model(stored, vocab_size, "llama", True, THETA, 1e-5)
    ids = [5, 17, 42, 7]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    with kt.Engine(str(path), device="cpu", dtype="float32", num_device_blocks=64,
                   skip_tokenizer_init=True) as engine:
        logits = engine.forward(ids, [ForwardTarget("logits")]).targets[0].tensor
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


def test_llama3_rope_freqs_become_llama3_scaling(tmp_path):
    """llama.cpp stores Llama 3.1's scaling as per-frequency divisors; transformers' reader
    drops them. 300 tokens, far past the original 64: the scaled model's logits, not the plain."""
    factors = llama3_rope_factors(THETA, HD, LLAMA3["factor"], LLAMA3["low_freq_factor"],
                                  LLAMA3["high_freq_factor"],
                                  LLAMA3["original_max_position_embeddings"]).astype(np.float32)
    path = tmp_path / "llama31.gguf"
    stored, vocab = build(path, "llama", T.Q8_0, True, THETA, 1e-5, seed=3, ctx=1024,
                          extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    stored.pop("rope_freqs.weight", None)
    plain = reference_model(stored, vocab, "llama", True, THETA, 1e-5, ctx=1024)
    config = plain.config
    config.rope_parameters = {"rope_theta": THETA, **LLAMA3}
    scaled = LlamaForCausalLM(config).eval()
    scaled.load_state_dict(plain.state_dict())
    ids = [1] + np.random.default_rng(0).integers(3, vocab, size=299).tolist()
    with torch.no_grad():
        want = scaled(torch.tensor([ids])).logits[0]
        unscaled = plain(torch.tensor([ids])).logits[0]
    converted = json.loads((convert_gguf_to_hf(path) / "config.json").read_text())
    assert {k: converted["rope_parameters"][k] for k in LLAMA3} == LLAMA3
    got = _logits(path, ids)
    assert (want - unscaled).abs().max() > 1e-2  # the scaling matters at this length
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch, kind", [("llama", "linear"), ("qwen2", "yarn")])
def test_rope_scaling_metadata_reaches_the_config(tmp_path, arch, kind):
    def scaling(writer):
        writer.add_rope_scaling_type(gguf_scaling_type(kind))
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(128)

    path = tmp_path / f"{arch}.gguf"
    build(path, arch, T.Q8_0, True, 1e6, 1e-5, extra=scaling)
    folder = convert_gguf_to_hf(path)
    rope = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == kind and rope["factor"] == 4.0 and rope["rope_theta"] == 1e6
    if kind == "yarn":
        assert rope["original_max_position_embeddings"] == 128
    # And the model runs with it, as transformers does on the converted folder: 300 tokens,
    # past the original 128.
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = [1] + np.random.default_rng(1).integers(3, reference.config.vocab_size,
                                                  size=299).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(path, ids), want, atol=1e-4, rtol=1e-4)


def gguf_scaling_type(kind: str):
    from gguf import RopeScalingType

    return RopeScalingType.LINEAR if kind == "linear" else RopeScalingType.YARN


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
    path = tmp_path / "odd.gguf"
    odd = np.linspace(1, 3, HD // 2).astype(np.float32)
    build(path, "llama", T.Q8_0, True, THETA, 1e-5,
          extra=lambda w: w.add_tensor("rope_freqs.weight", odd))
    with pytest.raises(ValueError, match="rope_freqs.weight holds frequency factors"):
        convert_gguf_to_hf(path)


def test_a_replaced_file_of_the_same_size_and_mtime_converts_again(tmp_path):
    """`cp -p` / `rsync -a` keep the mtime; a re-quantized file keeps the size."""
    path = tmp_path / "model.gguf"
    ids = [1, 45, 72, 101, 108, 108, 111, 2]
    build(path, "llama", T.Q4_0, True, 10000.0, 1e-5, seed=1)
    first = os.stat(path)
    old_folder = convert_gguf_to_hf(path)
    stored, vocab = build(tmp_path / "v2.gguf", "llama", T.Q4_0, True, 10000.0, 1e-5, seed=2)
    os.replace(tmp_path / "v2.gguf", path)
    os.utime(path, ns=(first.st_atime_ns, first.st_mtime_ns))
    assert os.stat(path).st_size == first.st_size
    assert gguf_cache_path(path) != old_folder
    with torch.no_grad():
        want = reference_model(stored, vocab, "llama", True, 10000.0, 1e-5)(
            torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(path, ids), want, atol=1e-4, rtol=1e-4)


def test_tokenizer_files_beside_the_gguf_do_not_replace_its_own(tmp_path, default_model_dir):
    """A folder that also holds another model's tokenizer files (SmolLM2's 49,152 tokens)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    path = folder / "tiny.gguf"
    build(path, "llama", T.Q8_0, True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / path.name).symlink_to(path)
    expected = AutoTokenizer.from_pretrained(str(alone), gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(convert_gguf_to_hf(path)))
    assert len(tokenizer) == len(expected) < 1000
    assert tokenizer("the hello").input_ids == expected("the hello").input_ids
    assert tokenizer.chat_template == expected.chat_template is not None
