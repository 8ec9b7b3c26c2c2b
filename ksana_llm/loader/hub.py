"""Hugging Face hub model ids (`Qwen/Qwen3-0.6B`), taken where a model path goes, as vLLM takes
them: resolved to a snapshot folder of the local Hugging Face cache (`--download-dir`, else
HF_HUB_CACHE / HF_HOME's), downloading what is missing unless the hub is offline
(HF_HUB_OFFLINE=1), at `revision` (a branch, tag or commit; default main).

A download fetches the files a model runs from: config and tokenizer files, the safetensors
weights, or the PyTorch .bin ones when the repository has no safetensors.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = ["hub_snapshot", "is_repo_id", "names_a_hub_repo"]

LOGGER = logging.getLogger(__name__)

# What a model runs from (weights apart): configs, tokenizers, chat templates, a KsanaLLM plugin.
_MODEL_FILES = ("*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "ksana_plugin.py")
_WEIGHTS = ("*.safetensors",)
_TORCH_WEIGHTS = ("*.bin", "*.pt")
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_repo_id(text: str) -> bool:
    """Whether `text` reads as a hub id ("name" or "owner/name") rather than a path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.startswith((".", "/", "~")) or text.count("/") > 1 or text.lower().endswith(".gguf"):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def names_a_hub_repo(model: str | os.PathLike[str]) -> bool:
    """Whether `model`, given where a model path goes, means a hub repository: it reads as a
    hub id and no local path of that name exists (a local folder always wins, as in vLLM)."""
    return not Path(model).expanduser().exists() and is_repo_id(str(model))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set now: huggingface_hub reads it once, at
    import, and a caller may set it later."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or any(
        os.environ.get(name, "").upper() in _TRUE
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_snapshot(repo_id: str, *, revision: str | None = None,
                 download_dir: str | os.PathLike[str] | None = None, what: str = "model",
                 token: str | bool | None = None) -> Path:
    """The folder of `repo_id` at `revision` in the Hugging Face cache, downloaded first when the
    cache lacks it. FileNotFoundError when it is not cached and cannot be downloaded (`what` the
    repository is for, in the message). `token` (vLLM's hf_token): the hub token to download
    with; None or True: huggingface_hub's own (HF_TOKEN, or the stored login)."""
    from huggingface_hub import snapshot_download

    where = f"{what} {repo_id!r} at revision {revision or 'main'!r}"
    try:  # the cache first: no network, and a model cached once keeps working offline
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                      local_files_only=True, token=token))
    except Exception as exc:  # noqa: BLE001 - any miss: not cached (or cached in part)
        cache_miss = exc
    cache = download_dir or "the Hugging Face cache"
    if hub_offline():
        raise FileNotFoundError(
            f"{where} is neither a local path nor in {cache}, and the hub is offline "
            f"(HF_HUB_OFFLINE): {cache_miss}") from cache_miss
    LOGGER.info("downloading %s from the Hugging Face hub into %s", where, cache)
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                        allow_patterns=[*_MODEL_FILES, *_WEIGHTS], token=token))
        if not any(folder.glob("*.safetensors")):  # an older repository: PyTorch .bin weights
            folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                            allow_patterns=[*_MODEL_FILES, *_TORCH_WEIGHTS],
                                            token=token))
    except Exception as exc:  # noqa: BLE001 - network, auth, unknown repository or revision
        raise FileNotFoundError(
            f"{where} is neither a local path nor in {cache}, and downloading it from "
            f"the Hugging Face hub failed: {type(exc).__name__}: {exc}") from exc
    return folder
