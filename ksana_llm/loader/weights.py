"""Find a model folder and stream its tensors, whatever checkpoint layout it uses.

Model code consumes ``(name, tensor)`` pairs one at a time, so a checkpoint never has to be
materialized twice in memory (once as a state dict, once as model parameters).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .default_model import default_model_gguf
from .gguf_convert import convert_gguf_to_hf
from .hub import hub_snapshot, names_a_hub_repo

LOGGER = logging.getLogger("ksana_llm.loader")

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN_SINGLE = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"


def iterate_weights(model_dir: str | os.PathLike[str], progress: bool = True, *,
                    matrices_as_meta: bool = False, load_format: str = "auto"
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the Hugging Face checkpoint in ``model_dir``.

    Supports single or sharded safetensors and single or sharded ``pytorch_model.bin``;
    safetensors wins when both exist, because it loads without unpickling and memory-maps.
    Tensors are on CPU. A tqdm bar ("Loading weights") counts tensors unless ``progress`` is
    False. With ``matrices_as_meta``, tensors of two or more dimensions come as meta tensors of
    their shape and dtype, read from the safetensors headers without their values (a dry run
    that checks where each tensor goes; ``.bin`` files are memory-mapped, so theirs are not
    read either); vectors keep their values. ``load_format`` "safetensors" or "pt" reads only
    those files (see ``ksana_llm.loader.load_format``).

    Raises:
        FileNotFoundError: no weight files in ``model_dir`` (or a shard named by an index is missing).
    """
    folder = Path(model_dir).expanduser()
    files, expected_total = _weight_files(folder, load_format)
    LOGGER.info("Loading %d weight file(s) from %s", len(files), folder)
    seen: dict[str, Path] = {}  # name -> its file: a second copy would silently win
    with tqdm(total=expected_total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path in files:
            tensors = (_iter_safetensors(path, matrices_as_meta) if path.suffix == ".safetensors"
                       else _iter_torch_bin(path))
            for name, tensor in tensors:
                if matrices_as_meta and tensor.dim() > 1 and not tensor.is_meta:
                    tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                first = seen.setdefault(name, path)
                if first != path:
                    raise ValueError(f"tensor {name!r} is in both {first.name} and {path.name} in "
                                     f"{folder}: two copies of the checkpoint? Keep one (or add "
                                     "the index that says which file holds what)")
                yield name, tensor
                bar.update(1)


def _weight_files(folder: Path, load_format: str = "auto") -> tuple[list[Path], int | None]:
    """Return the weight files of ``folder`` in load order, and the tensor count if an index tells
    it; only safetensors for ``load_format`` "safetensors", only ``.bin`` for "pt"."""
    if not folder.is_dir():
        raise FileNotFoundError(f"Model folder not found: {folder}")
    kinds = {"safetensors": ((SAFETENSORS_INDEX, SAFETENSORS_SINGLE),),
             "pt": ((TORCH_BIN_INDEX, TORCH_BIN_SINGLE),)}.get(
        load_format, ((SAFETENSORS_INDEX, SAFETENSORS_SINGLE), (TORCH_BIN_INDEX, TORCH_BIN_SINGLE)))
    for index_name, single_name in kinds:
        index_path = folder / index_name
        if index_path.is_file():
            return _shards_from_index(index_path)
        if (folder / single_name).is_file():
            return [folder / single_name], None
    # Some exports use other safetensors names (e.g. a lone "model-00001-of-00001.safetensors").
    loose = sorted(folder.glob("*.safetensors")) if load_format != "pt" else []
    if loose:
        return loose, None
    if load_format in ("safetensors", "pt"):
        index, single = kinds[0]
        raise FileNotFoundError(f"No {load_format} weight files in {folder} (load_format "
                                f"{load_format!r}): expected {single} or {index}")
    raise FileNotFoundError(
        f"No weight files found in {folder}: expected {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, "
        f"{TORCH_BIN_SINGLE} or {TORCH_BIN_INDEX}"
    )


def _shards_from_index(index_path: Path) -> tuple[list[Path], int]:
    """Read a sharded checkpoint's index: the shard files (first-use order) and the tensor count."""
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{index_path} is not a valid checkpoint index (need a 'weight_map' object)") from error
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
    # dict.fromkeys de-duplicates while keeping order, so shards load in the order the index lists them.
    shards = [index_path.parent / name for name in dict.fromkeys(weight_map.values())]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise FileNotFoundError(f"{index_path} references missing shard file(s): {', '.join(missing)}")
    return shards, len(weight_map)


# safetensors' dtype names (the header's) -> torch's.
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


def _iter_safetensors(path: Path, matrices_as_meta: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors of one safetensors file, one at a time (never the whole file at once);
    with `matrices_as_meta`, those of two or more dimensions as meta tensors (header only)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as error:
        raise ValueError(f"{path} is not a readable safetensors file (corrupt or truncated?): "
                         f"{error}") from error
    with handle:
        for name in handle.keys():
            if matrices_as_meta:
                header = handle.get_slice(name)
                shape, dtype = header.get_shape(), _SAFETENSORS_DTYPES.get(header.get_dtype())
                if len(shape) > 1 and dtype is not None:
                    yield name, torch.empty(shape, dtype=dtype, device="meta")
                    continue
            try:
                tensor = handle.get_tensor(name)
            except SafetensorError as error:
                raise ValueError(f"{path}: tensor {name!r} cannot be read (corrupt or truncated "
                                 f"file?): {error}") from error
            yield name, tensor


def _iter_torch_bin(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors of one ``pytorch_model.bin`` file."""
    state = _load_torch_file(path)
    if not isinstance(state, Mapping):
        raise ValueError(f"{path} does not contain a state dict (got {type(state).__name__})")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{path}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
        yield name, tensor


def _load_torch_file(path: Path) -> object:
    """``torch.load`` safely (``weights_only``) and memory-mapped when the file format allows it.

    mmap avoids reading a multi-GB shard into RAM up front, but only works for the zip format
    that torch has written since 1.6; older pickles are loaded normally.
    """
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            LOGGER.info("%s is in the legacy torch format; loading it without mmap", path.name)
            return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
        # Only weights are read (weights_only): a file torch cannot read that way is corrupt,
        # truncated, or not a checkpoint; torch's own advice to allow arbitrary code is not ours.
        raise ValueError(f"{path} is not a readable PyTorch checkpoint (corrupt, truncated, or "
                         f"not only tensors): {str(error).splitlines()[0]}") from error


def resolve_model_dir(
    path: str | os.PathLike[str] | None, *, cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None, download_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None
) -> Path:
    """Turn what the user passed as "the model" into a Hugging Face checkpoint folder.

    - ``None``: the bundled default model (its GGUF is converted once and cached);
    - a ``.gguf`` file: converted (and cached);
    - a folder with ``config.json``: used as is;
    - a folder without ``config.json`` holding exactly one ``.gguf`` file: that file, converted;
    - a Hugging Face hub id ("Qwen/Qwen3-0.6B") that is no local path: its snapshot at
      ``revision`` in the Hugging Face cache (``download_dir``, else the default one),
      downloaded when missing unless HF_HUB_OFFLINE is set (``ksana_llm.loader.hub``), with
      ``token`` (huggingface_hub's own when None).

    ``cache_dir`` overrides where GGUF conversions are cached (see ``convert_gguf_to_hf``).

    Raises:
        FileNotFoundError: the path does not exist (nor, as a hub id, in the cache or on the
            hub), or a folder holds neither config.json nor a GGUF file.
        ValueError: the path exists but is not usable (another file type, several GGUF files),
            or a revision was given for something other than a hub id.
    """
    target = None if path is None else Path(path).expanduser()
    if path is not None and names_a_hub_repo(path):
        return _resolve_folder(hub_snapshot(str(path), revision=revision,
                                            download_dir=download_dir, token=token), cache_dir)
    if revision is not None:
        raise ValueError(f"revision {revision!r} applies to Hugging Face hub model ids; the "
                         f"model {str(path) if path is not None else '(the default)'} is a "
                         "local path")
    if target is None:
        LOGGER.info("No model given; using the default model")
        return convert_gguf_to_hf(default_model_gguf(), cache_dir)

    if not target.exists():
        raise FileNotFoundError(
            f"Model path not found: {target} (expected a Hugging Face model folder with config.json or a .gguf file)"
        )
    if target.is_file():
        if target.suffix.lower() != ".gguf":
            raise ValueError(
                f"Unsupported model file {target}: expected a .gguf file or a Hugging Face model folder with config.json"
            )
        return convert_gguf_to_hf(target, cache_dir)
    return _resolve_folder(target, cache_dir)


def _resolve_folder(folder: Path, cache_dir: str | os.PathLike[str] | None) -> Path:
    """Resolve a folder: a HF checkpoint as is, or the single GGUF file it contains."""
    if (folder / "config.json").is_file():
        return folder.resolve()
    ggufs = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(ggufs) == 1:
        return convert_gguf_to_hf(ggufs[0], cache_dir)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(f"{folder} holds several GGUF files ({names}); pass the path of the one to load")
    raise FileNotFoundError(
        f"{folder} is not a model folder: expected a config.json (Hugging Face checkpoint) or exactly one .gguf file"
    )
