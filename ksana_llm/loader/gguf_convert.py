"""Convert a GGUF file into a plain fp32 Hugging Face checkpoint folder, cached on disk.

The engine's weight loader only understands Hugging Face folders (config.json + safetensors +
tokenizer files). Rather than writing our own GGUF dequantizer, we let transformers' GGUF
loader do the work once and keep the result: later runs read the cached folder directly.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from ksana_llm.loader.gguf_rope import gguf_rope_scaling, with_rope_scaling

LOGGER = logging.getLogger("ksana_llm.loader")

CACHE_ENV_VAR = "KSANA_LLM_CACHE"
# Written last into a converted folder. Its presence is what "complete" means, so a folder that
# somebody created by hand (or an older, interrupted layout) is never mistaken for a good one.
COMPLETE_MARKER = "ksana_llm_conversion.json"
_GGUF_MAGIC = b"GGUF"
# Part of the cache key: a conversion made by an older converter is made again (version 2
# states the file's RoPE scaling in config.json and reads the tokenizer from the file alone;
# version 3 refuses files missing tensors, which version 2 cached with made-up ones, and keeps
# a Qwen2 file's stated head size).
CONVERTER_VERSION = 3
_HEADER_BYTES = 1 << 20
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16
_STAGING_SUFFIX = ".tmp"
# Far longer than any conversion takes, so a live conversion's staging folder is never removed.
_STALE_STAGING_AGE_S = 24 * 3600


def default_cache_dir() -> Path:
    """Return the cache root: ``$KSANA_LLM_CACHE`` if set, else ``~/.cache/ksana_llm``.

    Read on every call (not at import) so tests and users can redirect it at any time.
    """
    configured = os.environ.get(CACHE_ENV_VAR)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "ksana_llm"


def gguf_cache_path(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder a GGUF file converts into: ``<cache>/gguf/<stem>-<hash>``.

    The hash covers the absolute path, size, mtime and sampled content (see `_fingerprint`),
    so replacing or editing the file yields a new folder instead of silently reusing a stale
    conversion, without reading the whole file on every start.
    """
    source = Path(gguf_path).expanduser().resolve()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "gguf" / f"{source.stem}-{_short_hash(_fingerprint(source))}"


def convert_gguf_to_hf(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Convert ``gguf_path`` into a Hugging Face fp32 model folder and return that folder.

    The folder holds config.json (without ``quantization_config``), model.safetensors, the
    tokenizer files (with the chat template) and generation_config.json when transformers
    provides one. A completed conversion is reused as is; a new one is written into a
    temporary sibling folder and moved into place with ``os.replace``, so the cache never holds
    a half-written folder under the final name, even if the process dies mid-way.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: ``gguf_path`` is not a GGUF file.
    """
    source = _validated_gguf(gguf_path)
    target = gguf_cache_path(source, cache_dir)
    if _is_complete(target):
        LOGGER.info("Using cached conversion of %s at %s", source, target)
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(target)
    staging = _new_staging_dir(target)
    LOGGER.info("Converting %s to a Hugging Face checkpoint in %s (done once, then cached)", source, target)
    started = time.perf_counter()
    try:
        _write_hf_folder(source, staging)
        _write_marker(staging, source)
        published = _publish(staging, target)
    except BaseException:
        # Also on KeyboardInterrupt: never leave multi-hundred-MB staging folders behind.
        shutil.rmtree(staging, ignore_errors=True)
        raise
    LOGGER.info("Converted %s in %.1f s", source.name, time.perf_counter() - started)
    return published


def _validated_gguf(gguf_path: str | os.PathLike[str]) -> Path:
    """Return the absolute path of ``gguf_path`` after checking it really is a GGUF file.

    Checking the magic bytes up front gives a clear error instead of a confusing one from deep
    inside transformers.
    """
    source = Path(gguf_path).expanduser().resolve()
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file not found: {source}")
    with source.open("rb") as handle:
        magic = handle.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise ValueError(f"{source} is not a GGUF file (it does not start with the 'GGUF' magic bytes)")
    return source


def _new_staging_dir(target: Path) -> Path:
    """Create an empty, uniquely named, hidden sibling of ``target`` to convert into.

    A sibling, so the final ``os.replace`` is a rename within one filesystem. Created with
    ``mkdir`` rather than ``tempfile.mkdtemp`` so it gets the usual umask permissions instead of
    0700: the published cache folder should be readable like any other.
    """
    staging = target.parent / f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{_STAGING_SUFFIX}"
    staging.mkdir()
    return staging


def _remove_stale_staging(target: Path) -> None:
    """Delete staging folders for ``target`` left by processes killed mid-conversion.

    Only old ones: a young staging folder may belong to a conversion still running elsewhere.
    """
    cutoff = time.time() - _STALE_STAGING_AGE_S
    for leftover in target.parent.glob(f".{target.name}.*{_STAGING_SUFFIX}"):
        try:
            if leftover.stat().st_mtime < cutoff:
                LOGGER.info("Removing leftover staging folder %s", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        except FileNotFoundError:
            continue  # another process cleaned it up first


def _fingerprint(source: Path) -> dict[str, Any]:
    """Describe the identity of a source file cheaply: path, size, mtime, a hash of its header
    (the metadata) and of samples spread over it (another file of the same size and mtime, as
    `cp -p` or `rsync -a` leave it, differs there), and what converts it (this converter's
    version, transformers')."""
    import transformers  # local: keeps `import ksana_llm.loader` cheap

    stat = source.stat()
    return {"path": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "content": _content_sample_hash(source, stat.st_size),
            "converter": CONVERTER_VERSION, "transformers": transformers.__version__}


def _content_sample_hash(source: Path, size: int) -> str:
    """sha256 of the first MiB and of 64 KiB at 16 offsets spread over the file (about 2 MiB
    read, whatever its size)."""
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        digest.update(f.read(_HEADER_BYTES))
        for i in range(_SAMPLES):
            f.seek(size * i // _SAMPLES)
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _short_hash(fingerprint: dict[str, Any]) -> str:
    """Hash a fingerprint into a short, filesystem-safe, stable string."""
    payload = json.dumps(fingerprint, sort_keys=True).encode("utf-8")
    return hashlib.sha256(payload).hexdigest()[:16]


def _is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished conversion (its marker is written last)."""
    return (folder / COMPLETE_MARKER).is_file()


def _write_marker(folder: Path, source: Path) -> None:
    """Record where the folder came from; also serves as the completeness marker."""
    import transformers  # local: keeps `import ksana_llm.loader` cheap

    record = {**_fingerprint(source), "transformers_version": transformers.__version__,
              "converted_at": time.time()}
    (folder / COMPLETE_MARKER).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _publish(staging: Path, target: Path) -> Path:
    """Atomically move a finished ``staging`` folder to ``target`` and return ``target``.

    If another process finished the same conversion first, its folder wins and ours is dropped:
    both are equivalent, and replacing a folder someone may be reading would be unsafe.
    """
    if target.exists() and not _is_complete(target):
        # Not produced by us (we only ever publish complete folders): treat it as stale.
        LOGGER.warning("Replacing incomplete or foreign folder %s", target)
        shutil.rmtree(target)
    try:
        os.replace(staging, target)
    except OSError:
        if not _is_complete(target):
            raise
        LOGGER.info("Another process already converted %s; using its result", target.name)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_hf_folder(source: Path, out_dir: Path) -> None:
    """Dequantize ``source`` with transformers and save model + tokenizer into ``out_dir``.

    transformers reads from a folder of its own holding only a link to the file: tokenizer or
    config files beside the GGUF (a folder several models share, or llama.cpp's converter's
    input) would otherwise be taken over the file's own vocabulary and chat template."""
    with tempfile.TemporaryDirectory(prefix="ksana-gguf-") as alone:
        link = Path(alone) / source.name
        link.symlink_to(source)
        _convert_alone(link, source, out_dir)


def _convert_alone(link: Path, source: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    _refuse_split_file(source)
    try:
        model, missing = _load_dense_model(link)
    except (ValueError, RuntimeError, OSError, KeyError, IndexError) as exc:
        # A GGUF whose header reads but whose tensors do not (a truncated download) fails
        # inside numpy with a reshape message that names neither the file nor the cause.
        raise ValueError(f"{source} cannot be loaded as a GGUF model: {exc} (a truncated or "
                         "corrupt file fails this way too)") from exc
    if missing:
        # transformers fills them with random values (and only says so in a log line); the
        # converted folder would then look complete to the engine's own check.
        raise ValueError(f"{source} is missing {len(missing)} of the model's tensors, e.g. "
                         f"{sorted(missing)[:5]} (a file cut short, or a block count its "
                         "tensors do not fill)")
    model.save_pretrained(out_dir, **_safetensors_kwargs(model.save_pretrained))
    del model  # free the fp32 weights before loading the tokenizer

    _state_rope_scaling(source, out_dir / "config.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(link.parent), gguf_file=link.name)
    except (ValueError, KeyError, IndexError, TypeError, OSError) as exc:
        # Broken or absent tokenizer metadata: the weights still serve token ids (as a folder
        # without a tokenizer does: `tokenizer=` or skip_tokenizer_init), so warn, not fail.
        LOGGER.warning("%s: its tokenizer cannot be read (%s: %s); the model loads without one "
                       "(pass tokenizer= a folder, or skip_tokenizer_init=True)", source,
                       type(exc).__name__, exc)
        tokenizer = None
    if tokenizer is not None:
        if not getattr(tokenizer, "chat_template", None):
            LOGGER.warning("%s has no chat template; chat requests will need one supplied",
                           source.name)
        tokenizer.save_pretrained(out_dir)
    _strip_quantization_config(out_dir / "config.json")
    if not (out_dir / "generation_config.json").is_file():
        LOGGER.info("transformers produced no generation_config.json for %s", source.name)


def _state_rope_scaling(source: Path, config_path: Path) -> None:
    """Write the RoPE scaling the GGUF states (which transformers' reader drops) into the
    converted config.json; see `gguf_rope`."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    theta = float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    scaling = gguf_rope_scaling(source, theta, int(head_dim))
    if scaling is not None:
        LOGGER.info("%s states RoPE scaling %s", source.name, scaling)
        config_path.write_text(json.dumps(with_rope_scaling(config, scaling), indent=2,
                                          sort_keys=True) + "\n", encoding="utf-8")


def _safetensors_kwargs(save_pretrained: Any) -> dict[str, bool]:
    """Ask for safetensors output where ``save_pretrained`` still has the switch.

    transformers 4.x takes ``safe_serialization=True``; 5.x always writes safetensors and would
    silently swallow the unknown keyword, so it is only passed where it means something.
    """
    if "safe_serialization" in inspect.signature(save_pretrained).parameters:
        return {"safe_serialization": True}
    return {}


def _refuse_split_file(source: Path) -> None:
    """A ValueError for one part of a split GGUF (llama.cpp's gguf-split): transformers reads
    the part's tensors alone and would make up the others."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(source)).fields.get("split.count")
    except (ValueError, RuntimeError, OSError, KeyError, IndexError):
        return  # unreadable (cut short): the load that follows names the file and the cause
    parts = None if field is None else int(field.contents())
    if parts is not None and parts > 1:
        raise ValueError(f"{source} is one of {parts} parts of a split GGUF model, which is not "
                         "supported: merge them into one file first (llama.cpp's "
                         "`llama-gguf-split --merge`)")


def _load_dense_model(source: Path) -> tuple[Any, list[str]]:
    """Load ``source`` through transformers' GGUF loader as a plain fp32 model; with the
    names of the model's tensors the file did not hold (transformers made them up)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"gguf_file": source.name, "dtype": torch.float32}
    config = _config_with_head_dim(source)
    if config is not None:
        kwargs["config"] = config
    dequantize = _dequantizing_gguf_config()
    if dequantize is not None:
        # Newer transformers may keep GGUF weights packed (and refuse to save them); ask for
        # dense weights explicitly.
        kwargs["quantization_config"] = dequantize
    model, info = AutoModelForCausalLM.from_pretrained(str(source.parent),
                                                       output_loading_info=True, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        model = _without_quantizer(model)
    return model, list(info.get("missing_keys") or ())


def _config_with_head_dim(source: Path) -> Any | None:
    """The file's config with `head_dim` from `<arch>.attention.key_length`, where
    transformers' GGUF reader left its default instead (Qwen3: 128, whatever the file says,
    and then every attention weight "mismatches"); None when it read it right."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    fields = GGUFReader(str(source)).fields
    arch_field = fields.get("general.architecture")
    arch = None if arch_field is None else arch_field.contents()
    key_length = fields.get(f"{arch}.attention.key_length")
    if key_length is None:
        return None
    config = AutoConfig.from_pretrained(str(source.parent), gguf_file=source.name)
    head_dim = int(key_length.contents())
    # (Some configs, Qwen2's, have no head_dim attribute: their model reads one when it is set,
    # else hidden / heads.)
    current = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    if current == head_dim:
        return None
    config.head_dim = head_dim
    return config


def _dequantizing_gguf_config() -> Any | None:
    """Return ``GgufConfig(dequantize=True)`` when this transformers version has it, else None.

    Older transformers always dequantize GGUF and have no such option.
    """
    try:
        from transformers import GgufConfig
    except ImportError:
        return None
    if "dequantize" not in inspect.signature(GgufConfig.__init__).parameters:
        return None
    return GgufConfig(dequantize=True)


def _without_quantizer(model: Any) -> Any:
    """Rebuild ``model`` as an unquantized model sharing the same (dense) tensors.

    transformers refuses to ``save_pretrained`` a model that still carries a non-serializable
    GGUF quantizer even when every weight is already dense. Building the architecture on the
    meta device and assigning the loaded tensors avoids a second copy of the weights. A strict
    load fails loudly if any weight is still packed.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(model.state_dict(), strict=True, assign=True)
    clean.tie_weights()
    clean.generation_config = copy.deepcopy(model.generation_config)
    return clean


def _strip_quantization_config(config_path: Path) -> None:
    """Drop ``quantization_config`` from a saved config.json: the weights are plain fp32 now.

    Left in place, downstream loaders would try to treat the safetensors as GGUF-quantized.
    """
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
