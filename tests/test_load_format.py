"""vLLM's `load_format` (`Model.from_pretrained(load_format=)`, `EngineConfig.load_format`,
`--load-format`): "dummy" weights equal transformers' model given the same made-up tensors (one
rank and two gloo ranks), none read from the folder; "safetensors" / "pt" read only those files
of a folder holding both (each against the transformers model saved in it); bad values are
clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import ksana_llm as kt
from ksana_llm.loader.default_model import default_model_gguf
from ksana_llm.loader.load_format import check_load_format, dummy_weights
from tests.family_harness import greedy_trace, hf_reference
from tests.tiny_models import build_tiny_chat_model, build_tiny_model

PROMPT = [1, 5, 9, 33, 17, 99, 120, 7, 8, 3]
STEPS = 6


def _hf_with_dummy_weights(folder: Path) -> torch.nn.Module:
    """transformers' model for `folder`'s config, holding `dummy_weights` (tied copies follow)."""
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = model.load_state_dict(dict(dummy_weights(config)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert not missing or config.tie_word_embeddings
    return model


def _greedy(model: kt.Model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    config = kt.GenerationConfig(max_new_tokens=STEPS, ignore_eos=True)
    with kt.Engine(model, num_device_blocks=64, block_token_num=4) as engine:
        tokens = engine.generate_outputs(prompt, config, use_tqdm=False)[0].token_ids
        logits = engine.forward(prompt, [{"target_name": "logits"}]).targets[0].tensor
    return tokens, logits


def test_dummy_weights_match_transformers_with_the_same_tensors(default_model_dir,
                                                                default_model, tmp_path):
    """From a folder with no weight files at all (config and tokenizer only)."""
    folder = tmp_path / "no-weights"
    shutil.copytree(default_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                     load_format="dummy")
    assert model.load_format == "dummy"
    tokens, logits = _greedy(model, PROMPT)
    reference = hf_reference(_hf_with_dummy_weights(default_model_dir))
    expected, expected_logits = greedy_trace(reference, PROMPT, STEPS)
    assert tokens == expected[len(PROMPT):]
    torch.testing.assert_close(logits, expected_logits[:len(PROMPT)], atol=2e-4, rtol=1e-4)
    # Not the folder's weights.
    _, real_logits = _greedy(default_model, PROMPT)
    assert not torch.allclose(logits, real_logits, atol=1e-1)


def test_dummy_weights_agree_across_tensor_parallel_ranks(default_model_dir, tmp_path):
    folder = tmp_path / "tiny"
    build_tiny_chat_model(folder, default_model_dir)
    reference = hf_reference(_hf_with_dummy_weights(folder))
    expected, _ = greedy_trace(reference, PROMPT, STEPS)
    with kt.Engine(str(folder), device="cpu", dtype="float32", load_format="dummy",
                   tensor_parallel_size=2, num_device_blocks=64, block_token_num=4) as engine:
        assert engine.model.load_format == "dummy"
        out = engine.generate_outputs(PROMPT, kt.GenerationConfig(
            max_new_tokens=STEPS, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == expected[len(PROMPT):]


def test_dummy_weights_for_norm_offset_families(tmp_path):
    """Gemma stores norm weights as offsets from 1: its made-up norms are offsets of 0 (a scale
    of 1, as transformers initialises them), and the engine matches transformers holding the
    same made-up tensors."""
    from transformers import Gemma2Config

    config = Gemma2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          vocab_size=256, sliding_window=8, query_pre_attn_scalar=16,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    folder = tmp_path / "gemma2"
    config.save_pretrained(folder)
    made_up = dict(dummy_weights(config, norm_offsets=True))
    assert not made_up["model.layers.0.input_layernorm.weight"].any()
    model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                     load_format="dummy")
    norm = model.module.model.layers[1].pre_feedforward_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    hf = AutoModelForCausalLM.from_config(config).eval()
    hf.load_state_dict(made_up, strict=False)
    expected, _ = greedy_trace(hf_reference(hf), PROMPT, STEPS)
    assert _greedy(model, PROMPT)[0] == expected[len(PROMPT):]


def test_safetensors_or_pt_reads_only_those_files(tmp_path):
    """A folder with model.safetensors (one model) and pytorch_model.bin (another)."""
    folder, other = tmp_path / "both", tmp_path / "other"
    safetensors_model = build_tiny_model("llama2", folder, seed=0)
    bin_model = build_tiny_model("llama2", other, seed=1)
    torch.save(bin_model.state_dict(), folder / "pytorch_model.bin")
    expected = {name: greedy_trace(hf_reference(m), PROMPT, STEPS)[0][len(PROMPT):]
                for name, m in (("safetensors", safetensors_model), ("pt", bin_model))}
    assert expected["safetensors"] != expected["pt"]
    for load_format, which in (("auto", "safetensors"), ("safetensors", "safetensors"),
                               ("pt", "pt")):
        model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                         load_format=load_format)
        assert _greedy(model, PROMPT)[0] == expected[which], load_format
    with pytest.raises(FileNotFoundError, match=r"No pt weight files in .*load_format 'pt'\): "
                       r"expected pytorch_model\.bin or pytorch_model\.bin\.index\.json"):
        kt.Model.from_pretrained(_only_safetensors(folder, tmp_path), device="cpu",
                                 progress=False, load_format="pt")


def _only_safetensors(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "only-safetensors"
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns("*.bin"))
    return target


def test_bad_load_formats_are_clear_errors(default_model_dir, default_model, tmp_path):
    with pytest.raises(ValueError, match="load_format 'tensorizer' is not supported"):
        kt.Model.from_pretrained(default_model_dir, load_format="tensorizer")
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors"):
        kt.Model.from_pretrained(default_model_dir, load_format="safetensor")
    with pytest.raises(ValueError, match="load_format 'gguf' needs the path of a .gguf file"):
        kt.Model.from_pretrained(default_model_dir, load_format="gguf")
    upper = tmp_path / "MODEL.GGUF"  # the extension in any case, as the loader reads it
    upper.symlink_to(default_model_gguf())
    for folder_format in ("safetensors", "pt"):  # they read folders; 'auto' converts a GGUF
        for gguf in (default_model_gguf(), upper):
            with pytest.raises(ValueError, match=f"load_format '{folder_format}' reads a model "
                                                 r"folder's .* is a GGUF file"):
                kt.Model.from_pretrained(gguf, load_format=folder_format)
    assert check_load_format("gguf", upper) == "gguf"
    with pytest.raises(ValueError, match="load_format"):
        kt.EngineConfig(load_format="npcache")
    with pytest.raises(ValueError, match="load_format='dummy' applies while a model loads"):
        kt.Engine(default_model, load_format="dummy")
    # In a config given with a loaded model, the model's own settings replace it.
    with kt.Engine(default_model, config=kt.EngineConfig(load_format="dummy"),
                   num_device_blocks=16) as engine:
        assert engine.config.load_format == "auto"

    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    assert configs_from_args(parse(["serve", "--load-format", "dummy"]))[0].load_format == "dummy"
    assert configs_from_args(parse(["serve"]))[0].load_format == "auto"
    with pytest.raises(SystemExit):
        parse(["serve", "--load-format", "tensorizer"])

