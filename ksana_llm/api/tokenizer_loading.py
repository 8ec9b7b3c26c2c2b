"""A model folder's tokenizer and the token facts that come with it: EOS ids, the pad token.

`Model.from_pretrained` loads the folder's own (None when it has none: token ids still run) or
the one asked for by name (`load_tokenizer`: a folder or hub id, checked against the model)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ksana_llm.loader.hub import hub_snapshot, is_repo_id
from ksana_llm.loader.json_files import GENERATION_CONFIG_FILE, read_json_object

logger = logging.getLogger("ksana_llm.model")


def find_eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer, in that order."""
    found: list[int] = []
    sources: list[Any] = []
    gen_path = model_dir / GENERATION_CONFIG_FILE
    if gen_path.exists():
        sources.append(read_json_object(gen_path).get("eos_token_id"))
    sources.append(getattr(hf_config, "eos_token_id", None))
    sources.append(getattr(tokenizer, "eos_token_id", None))
    for value in sources:
        for token in (value if isinstance(value, list) else [value]):
            if isinstance(token, int) and token not in found:
                found.append(token)
    return tuple(found)


def load_folder_tokenizer(model_dir: Path, *, trust_remote_code: bool = False) -> Any:
    """The folder's tokenizer, or None (weights-only folders still run on token ids).

    A tokenizer that only the folder's own Python code builds (an `auto_map`, as Baichuan's and
    Qwen v1's ship) loads only with `trust_remote_code` (vLLM's rule): without it transformers
    would ask on stdin whether to run that code, stalling a server and running it on "y"."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - a broken tokenizer file fails in many ways
        # transformers' own message names trust_remote_code where the folder's code is needed.
        logger.warning("no usable tokenizer in %s (%s: %s); pass one to Engine(tokenizer=...)",
                       model_dir, type(exc).__name__, exc)
        return None
    if not _tokenizes_text(tokenizer):
        logger.warning("no usable tokenizer in %s (the one transformers built there has no "
                       "vocabulary: no tokenizer files?); pass one to Engine(tokenizer=...)",
                       model_dir)
        return None
    return tokenizer


def _tokenizes_text(tokenizer: Any) -> bool:
    """Whether `tokenizer` turns plain text into tokens. transformers builds an empty tokenizer
    (one special token, no vocabulary) for some folders without tokenizer files instead of
    failing; every text prompt would then be zero tokens."""
    try:
        return bool(tokenizer.encode("Hello world", add_special_tokens=False))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode is no more usable
        return False


def load_tokenizer(path: str | os.PathLike, vocab_size: int, *,
                   download_dir: str | os.PathLike | None = None, revision: str | None = None,
                   token: str | bool | None = None, trust_remote_code: bool = False) -> Any:
    """The tokenizer in folder `path`, or of the Hugging Face hub id "owner/name" (vLLM's
    --tokenizer Qwen/Qwen3-0.6B: the HF cache's snapshot at `revision` (vLLM's
    tokenizer_revision), downloaded with `token` when missing, as for models), asked for by
    name (unlike the model folder's own, which may be missing): ValueError naming `tokenizer`
    when it does not load or holds tokens the model has no embedding for. The folder's own
    tokenizer code runs only with `trust_remote_code`, as for the model's folder."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if folder.is_dir() and revision is not None:
        raise ValueError(f"tokenizer_revision {revision!r} applies to Hugging Face hub ids; "
                         f"the tokenizer {path} is a local folder")
    if not folder.is_dir():
        # Only "owner/name" is looked up on the hub: a bare name is far likelier a folder
        # mistyped than a legacy hub id, and must not fetch someone else's tokenizer.
        if "/" not in str(path) or not is_repo_id(str(path)):
            raise ValueError(f"tokenizer: {path} is not a folder")
        try:
            folder = hub_snapshot(str(path), revision=revision, download_dir=download_dir,
                                  what="tokenizer", token=token)
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - a broken folder fails in many ways
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path} "
                         f"({type(exc).__name__}: {exc})") from exc
    if not _tokenizes_text(tokenizer):
        raise ValueError(f"tokenizer: {path} holds no usable tokenizer (text encodes to no "
                         "tokens: no tokenizer files?)")
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer: {path} has {len(tokenizer)} tokens, more than the model's "
                         f"vocab_size {vocab_size}: it is not this model's tokenizer")
    return tokenizer


def set_pad_token(tokenizer: Any, pad_token_id: int | None, vocab_size: int) -> None:
    """Name the tokenizer's pad token `pad_token_id` where it has none (ValueError for an id
    outside the vocabulary)."""
    if pad_token_id is None:
        return
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) \
            or not 0 <= pad_token_id < vocab_size:
        raise ValueError(f"pad_token_id must be a token id in [0, {vocab_size}), got "
                         f"{pad_token_id!r}")
    if getattr(tokenizer, "pad_token_id", None) is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_token_id)
