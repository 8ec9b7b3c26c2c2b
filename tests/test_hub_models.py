"""Hugging Face hub model ids (vLLM's `serve Qwen/Qwen3-0.6B`): resolved through huggingface_hub
from a real cache folder laid out as it lays one out (refs naming commits, snapshots holding the
files). This machine cannot reach the hub, so the download itself is not exercised: only that a
model the cache lacks fails clearly, offline at once and online after the attempt."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

import ksana_llm as kt
from ksana_llm.loader import resolve_model_dir
from tests.family_harness import greedy_trace, hf_reference
from tests.tiny_models import build_tiny_chat_model

PROMPT = [1, 5, 9, 33, 17, 99, 120, 7, 8, 3]
STEPS = 5
REPO = "tiny-org/tiny-chat"


def cache_repo(cache: Path, repo: str, snapshots: dict[str, Path]) -> dict[str, Path]:
    """`repo` in `cache` as huggingface_hub lays it out: refs/<ref> holds a commit hash and
    snapshots/<hash>/ the files. Returns ref -> snapshot folder."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    folders = {}
    for ref, source in snapshots.items():
        commit = hashlib.sha1(f"{repo}@{ref}".encode()).hexdigest()
        (root / "refs" / ref).write_text(commit)
        folders[ref] = root / "snapshots" / commit
        shutil.copytree(source, folders[ref])
    return folders


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, default_model_dir):
    """A cache holding REPO at main (seed 0) and at a tag v2 (seed 1), and their HF models."""
    work = tmp_path_factory.mktemp("hub")
    models = {}
    for ref, seed in (("main", 0), ("v2", 1)):
        models[ref] = build_tiny_chat_model(work / ref, default_model_dir, seed=seed)
    cache = work / "cache"
    cache_repo(cache, REPO, {"main": work / "main", "v2": work / "v2"})
    return cache, models


def greedy(model: kt.Model) -> list[int]:
    with kt.Engine(model, num_device_blocks=64, block_token_num=4) as engine:
        return engine.generate_outputs(PROMPT, kt.GenerationConfig(
            max_new_tokens=STEPS, ignore_eos=True), use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("revision", [None, "v2"])
def test_a_hub_id_loads_its_snapshot_at_the_revision(hub_cache, revision):
    cache, models = hub_cache
    model = kt.Model.from_pretrained(REPO, device="cpu", dtype="float32", progress=False,
                                     revision=revision, download_dir=cache)
    expected, _ = greedy_trace(hf_reference(models[revision or "main"]), PROMPT, STEPS)
    assert greedy(model) == expected[len(PROMPT):]


def test_the_engine_config_and_the_server_flags_carry_the_revision(hub_cache, monkeypatch):
    cache, models = hub_cache
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args
    from ksana_llm.server.engine_args import default_served_model_name

    config = configs_from_args(build_parser().parse_args(
        ["serve", REPO, "--revision", "v2", "--download-dir", str(cache)]))[0]
    assert (config.model, config.revision, config.download_dir) == (REPO, "v2", str(cache))
    assert default_served_model_name(REPO) == REPO  # as vLLM names it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache alone serves it
    settings = {"device": "cpu", "dtype": "float32", "num_device_blocks": 64,
                "block_token_num": 4}
    with kt.Engine(config=config.model_copy(update=settings)) as engine:
        out = engine.generate_outputs(PROMPT, kt.GenerationConfig(
            max_new_tokens=STEPS, ignore_eos=True), use_tqdm=False)[0]
    expected, _ = greedy_trace(hf_reference(models["v2"]), PROMPT, STEPS)
    assert out.token_ids == expected[len(PROMPT):]


def test_what_the_cache_lacks_fails_clearly(hub_cache, monkeypatch, tmp_path):
    cache, _ = hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="'tiny-org/absent'.*offline"):
        resolve_model_dir("tiny-org/absent", download_dir=cache)
    with pytest.raises(FileNotFoundError, match="revision 'v3'.*offline"):
        resolve_model_dir(REPO, revision="v3", download_dir=cache)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    # Online, the hub is asked; unreachable here, the attempt fails with its reason.
    with pytest.raises(FileNotFoundError, match="downloading it from the Hugging Face hub"):
        resolve_model_dir("tiny-org/absent", download_dir=tmp_path / "empty-cache")


def test_a_revision_for_a_local_model_is_refused(default_model_dir):
    with pytest.raises(ValueError, match="revision 'v2' applies to Hugging Face hub model ids"):
        resolve_model_dir(default_model_dir, revision="v2")
    with pytest.raises(ValueError, match="revision"):
        kt.Model.from_pretrained(None, revision="v2")


def test_a_revision_given_with_a_loaded_model_is_refused(default_model):
    with pytest.raises(ValueError, match="revision='v2' applies while a model loads"):
        kt.Engine(default_model, revision="v2", num_device_blocks=16)
    with pytest.raises(ValueError, match="tokenizer_revision applies while a model"):
        kt.Engine(default_model, tokenizer_revision="v2", num_device_blocks=16)


def test_a_tokenizer_hub_id_reads_the_cache(hub_cache, monkeypatch, default_model_dir, tmp_path):
    """--tokenizer owner/name as vLLM takes it; a bare name that is no folder stays a mistyped
    folder (tests/test_tokenizer_override.py), never a hub lookup."""
    from transformers import AutoTokenizer

    cache, _ = hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    weights_only = tmp_path / "weights-only"
    build_tiny_chat_model(weights_only, default_model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (weights_only / name).unlink(missing_ok=True)
    model = kt.Model.from_pretrained(weights_only, device="cpu", dtype="float32", progress=False,
                                     tokenizer=REPO, download_dir=cache)
    reference = AutoTokenizer.from_pretrained(default_model_dir)
    text = "The capital of France is"
    assert model.tokenizer.encode(text) == reference.encode(text)
    with pytest.raises(ValueError, match="tokenizer 'tiny-org/absent' .*offline"):
        kt.Model.from_pretrained(weights_only, device="cpu", progress=False,
                                 tokenizer="tiny-org/absent", download_dir=cache)


PLUGIN_CODE = '''
from pathlib import Path

Path(__file__).with_name("plugin-ran").write_text("imported")


class KsanaPlugin:
    def init_plugin(self, **kwargs):
        pass
'''


def test_a_hub_repositorys_plugin_runs_only_with_trust_remote_code(
        hub_cache, tmp_path, caplog, monkeypatch):
    """A ksana_plugin.py is Python code: one that came with a hub repository is not imported
    unless trust_remote_code (vLLM's rule for a repository's code; it used to run at once). A
    local folder's own plugin still runs (tests/test_plugin.py)."""
    source = tmp_path / "with-plugin"
    shutil.copytree(resolve_model_dir(REPO, download_dir=hub_cache[0]), source)
    (source / "ksana_plugin.py").write_text(PLUGIN_CODE)
    cache = tmp_path / "cache"
    snapshot = cache_repo(cache, "tiny-org/with-plugin", {"main": source})["main"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    load = dict(device="cpu", dtype="float32", progress=False, download_dir=cache)
    with caplog.at_level("WARNING", logger="ksana_llm"):
        model = kt.Model.from_pretrained("tiny-org/with-plugin", **load)
    assert model.plugin is None and not (snapshot / "plugin-ran").exists()
    assert "ships a ksana_plugin.py: not run" in caplog.text
    trusted = kt.Model.from_pretrained("tiny-org/with-plugin", trust_remote_code=True, **load)
    assert trusted.plugin is not None and (snapshot / "plugin-ran").read_text() == "imported"

    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    assert configs_from_args(parse(["serve", "--trust-remote-code"]))[0].trust_remote_code
    assert not configs_from_args(parse(["serve"]))[0].trust_remote_code


def test_a_tokenizer_revision_picks_the_snapshot(hub_cache, monkeypatch, default_model_dir):
    """vLLM's tokenizer_revision: of --tokenizer's hub id, or (without one) of the hub model's
    own tokenizer; a revision the cache lacks fails naming it, and one for a local folder is
    refused."""
    from transformers import AutoTokenizer

    cache, _ = hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reference = AutoTokenizer.from_pretrained(default_model_dir)
    text = "The capital of France is"
    settings = {"device": "cpu", "dtype": "float32", "progress": False, "download_dir": cache}
    for tokenizer in (REPO, None):
        model = kt.Model.from_pretrained(REPO, tokenizer=tokenizer, tokenizer_revision="v2",
                                         **settings)
        assert model.tokenizer.encode(text) == reference.encode(text)
        with pytest.raises(ValueError, match="tokenizer 'tiny-org/tiny-chat' at revision 'v3'"):
            kt.Model.from_pretrained(REPO, tokenizer=tokenizer, tokenizer_revision="v3",
                                     **settings)
    with pytest.raises(ValueError, match="tokenizer_revision 'v2' applies to Hugging Face hub"):
        kt.Model.from_pretrained(default_model_dir, tokenizer_revision="v2", **settings)
    with pytest.raises(ValueError, match="tokenizer_revision 'v2' applies to Hugging Face hub"):
        kt.Model.from_pretrained(REPO, tokenizer=default_model_dir, tokenizer_revision="v2",
                                 **settings)


def test_the_hf_token_reaches_the_hub_and_stays_out_of_logs(hub_cache, monkeypatch):
    """--hf-token (vLLM's) is what huggingface_hub is called with. The hub cannot be reached
    here, so the call is watched on its way to huggingface_hub's real snapshot_download (which
    serves the cache); the token never shows in the config's repr."""
    import huggingface_hub

    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    cache, _ = hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    real, tokens = huggingface_hub.snapshot_download, []

    def watched(*args, **kwargs):
        tokens.append(kwargs.get("token"))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", watched)
    config = configs_from_args(build_parser().parse_args(
        ["serve", REPO, "--download-dir", str(cache), "--hf-token", "hf_secret",
         "--tokenizer-revision", "v2"]))[0]
    assert (config.hf_token, config.tokenizer_revision) == ("hf_secret", "v2")
    assert "hf_secret" not in repr(config)
    kt.Model.from_pretrained(config.model, device="cpu", dtype="float32", progress=False,
                             download_dir=cache, hf_token=config.hf_token,
                             tokenizer_revision=config.tokenizer_revision)
    assert tokens and set(tokens) == {"hf_secret"}  # the model's snapshot and the tokenizer's
    assert build_parser().parse_args(["serve", "--hf-token"]).hf_token is True
