"""`Model.from_pretrained`: a checkpoint folder (or GGUF file, or nothing) to weights on a device."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ksana_llm.api.plugin import PLUGIN_FILENAME, Plugin, load_plugin
from ksana_llm.api.tokenizer_loading import (find_eos_token_ids, load_folder_tokenizer,
                                             load_tokenizer, set_pad_token)
from ksana_llm.config import DTYPE_ALIASES, EngineConfig
from ksana_llm.distributed.launch import start_master, stop_workers
from ksana_llm.distributed.runtime import LaunchSpec, Runtime, multi_node_env, shutdown_runtime
from ksana_llm.loader import load_hf_config, resolve_model_dir
from ksana_llm.loader.hf_config import hf_overrides_applied
from ksana_llm.loader.hub import names_a_hub_repo
from ksana_llm.loader.load_format import check_load_format
from ksana_llm.models.factory import check_parallel_sizes, check_quantization, load_model_module
from ksana_llm.models.sequence_classification import (TOKEN_IDS_KEY, ClassifierHead,
                                                      classification_architecture,
                                                      classifier_token_ids)

logger = logging.getLogger("ksana_llm.model")

# Settings that shape how a model loads: given with an already-loaded Model, they cannot apply.
_LOAD_SETTINGS = ("device", "dtype", "quantization", "tensor_parallel_size", "pipeline_parallel_size",
                  "hf_overrides", "load_format", "revision", "download_dir")

_DTYPES = MappingProxyType({"float32": torch.float32, "float16": torch.float16,
                            "bfloat16": torch.bfloat16})


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device a model loads on. "cuda" (and "auto" on a GPU machine) becomes the
    current GPU with its index: its tensors report one (cuda:0), and the calls that pick a GPU
    (torch.cuda.set_device, a Triton launch's current device) need it."""
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        # CPUs are fastest and exact in float32; GPUs want half precision.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, float16, bfloat16; got {dtype!r}")
    return _DTYPES[name]


def resolve_parallel_size(name: str, value: int, device: torch.device | None) -> int:
    """A parallel size as given, or, for tensor_parallel_size 0, every visible GPU."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if value == 0:
        if device is None or device.type != "cuda":
            raise ValueError(f"{name} 0 means every visible GPU; give an explicit size on the CPU")
        return torch.cuda.device_count()
    return value


# The module attribute listing the engines built on a model's weights (`Model.add_engine`).
_ENGINES_ATTR = "_ksana_llm_engines"
_WORKERS_TAKEN_ATTR = "_ksana_llm_workers_taken"  # a parallel model's ranks serve an engine


@dataclass
class Model:
    """Weights on a device plus what the engine needs to drive them."""

    module: nn.Module
    hf_config: Any
    tokenizer: Any
    path: Path
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    plugin: Plugin | None = None  # the folder's ksana_plugin.py, loaded and initialised
    # A parallel run: this rank's process groups, and the worker processes this node started.
    runtime: Runtime | None = None
    workers: list[Any] = field(default_factory=list)
    load_format: str = "auto"  # where the weights came from (ksana_llm.loader.load_format)
    quantization: str | None = None  # the online quantization it was loaded with ("fp8", ...)

    @property
    def max_context(self) -> int:
        """The longest sequence the model serves exactly: the model class may know better than
        `max_position_embeddings` (Qwen v1's dynamic-NTK limit, Baichuan's model_max_length)."""
        own = getattr(self.module, "max_context", None)
        if own is not None:
            return int(own)
        return int(getattr(self.hf_config, "max_position_embeddings", 2048))

    @property
    def classifier(self) -> ClassifierHead | None:
        """A `*ForSequenceClassification` checkpoint's `score` head; None for a language model."""
        return getattr(self.module, "classifier", None)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as EngineConfig names it ("float32", "bfloat16", ...)."""
        return str(self.dtype).removeprefix("torch.")

    def with_tokenizer(self, path: str | os.PathLike, *, revision: str | None = None,
                       download_dir: str | os.PathLike | None = None,
                       token: str | bool | None = None,
                       trust_remote_code: bool = False) -> Model:
        """This model (the same weights) with the tokenizer in folder (or hub id) `path`
        instead of its own, its EOS ids read again with it (its folder's code runs only with
        `trust_remote_code`)."""
        tokenizer = load_tokenizer(path, self.vocab_size, revision=revision,
                                   download_dir=download_dir, token=token,
                                   trust_remote_code=trust_remote_code)
        return replace(self, tokenizer=tokenizer, eos_token_ids=find_eos_token_ids(
            self.path, self.hf_config, tokenizer))

    def without_tokenizer(self) -> Model:
        """This model (the same weights) with no tokenizer (vLLM's skip_tokenizer_init): its
        EOS ids are those of generation_config.json / config.json, as `from_pretrained` reads
        them then."""
        return replace(self, tokenizer=None,
                       eos_token_ids=find_eos_token_ids(self.path, self.hf_config, None))

    def add_engine(self, engine: Any) -> None:
        """`engine` serves these weights (kept weakly, on the module: `with_tokenizer` copies
        share it)."""
        self.module.__dict__.setdefault(_ENGINES_ATTR, weakref.WeakSet()).add(engine)

    def check_sole_engine(self, engine: Any, what: str) -> None:
        """ValueError unless `engine` is the only running engine on these weights: `what`
        (sleeping, new weights) would change them under the others' steps."""
        others = [e for e in self.module.__dict__.get(_ENGINES_ATTR, ())
                  if e is not engine and e.is_running]
        if others:
            raise ValueError(f"{what}: {len(others)} other running engine(s) serve this "
                             "engine's Model (the same weights), which would change under their "
                             "steps; give each engine its own Model (Engine(path) loads one) or "
                             "shut the others down first")

    def check_workers_free(self) -> None:
        """ValueError when this parallel model's worker ranks were told to build an engine's
        runner already: they serve that one engine and stop with it (or with its failure). A
        single-process model serves any number of engines."""
        if self.runtime is not None and self.module.__dict__.get(_WORKERS_TAKEN_ATTR):
            raise ValueError("this tensor/pipeline-parallel Model already served an engine, "
                             "whose end stopped its worker ranks; load the model again "
                             "(Model.from_pretrained, or Engine(path)) for another engine")

    def mark_workers_taken(self) -> None:
        """The worker ranks are building an engine's runner now (see `check_workers_free`)."""
        self.module.__dict__[_WORKERS_TAKEN_ATTR] = True

    def release_workers(self) -> None:
        """Stop the worker ranks this model started and leave its process groups (a parallel
        load whose engine never started: an engine's runner tells them to stop itself)."""
        stop_workers(self.workers)
        if self.runtime is not None:
            shutdown_runtime()

    def check_load_settings(self, config: EngineConfig, given: Iterable[str]) -> None:
        """ValueError for a setting that shapes how a model loads (device, dtype, quantization,
        parallel sizes, hf_overrides), named in `given` and set in `config`, that this loaded model does not
        match: it could not apply, and would otherwise be ignored without a word."""
        ctx = self.runtime.ctx if self.runtime is not None else None
        actual: dict[str, Any] = {"device": self.device, "dtype": self.dtype_name,
                                  "quantization": self.quantization,
                                  "tensor_parallel_size": ctx.tp_size if ctx else 1,
                                  "pipeline_parallel_size": ctx.pp_size if ctx else 1,
                                  "load_format": self.load_format,
                                  # where the files came from: nothing a loaded model can change
                                  "revision": None, "download_dir": None}
        for name in _LOAD_SETTINGS:
            wanted = getattr(config, name)
            if name not in given or wanted == "auto":
                continue
            if name == "hf_overrides":
                matches = not wanted or hf_overrides_applied(self.hf_config, wanted)
                actual[name] = "not applied"
            elif name == "device":
                try:
                    device = torch.device(wanted)
                except RuntimeError as exc:
                    raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {wanted!r}") from exc
                matches = device.type == self.device.type and device.index in (None, self.device.index)
            else:
                matches = wanted == actual[name]
            if not matches:
                raise ValueError(f"{name}={wanted!r} applies while a model loads; this model is "
                                 f"loaded already ({name} {actual[name]}): pass it to "
                                 "Model.from_pretrained, or give the Engine the model's path")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike | None = None, *, device: str | None = "auto",
                        dtype: str | torch.dtype | None = "auto", tensor_parallel_size: int = 1,
                        pipeline_parallel_size: int = 1, progress: bool = True,
                        plugin: bool | str | os.PathLike = True,
                        quantization: str | None = None, pad_token_id: int | None = None,
                        tokenizer: str | os.PathLike | None = None,
                        hf_overrides: dict[str, Any] | None = None,
                        load_format: str = "auto", revision: str | None = None,
                        download_dir: str | os.PathLike | None = None,
                        skip_tokenizer_init: bool = False,
                        trust_remote_code: bool = False, tokenizer_revision: str | None = None,
                        hf_token: str | bool | None = None) -> Model:
        """Load an HF folder, a .gguf file, a Hugging Face hub id ("Qwen/Qwen3-0.6B") or (path
        None) the embedded SmolLM2-135M-Instruct.

        A hub id (vLLM's): the snapshot at `revision` (branch, tag or commit; default main) in
        the Hugging Face cache (`download_dir`, else HF_HUB_CACHE / HF_HOME's), downloaded when
        missing unless HF_HUB_OFFLINE is set (`ksana_llm.loader.hub`).

        Checkpoint tensor names go through `<model_type>_weight_map.json` when the folder or the
        package has one (see `ksana_llm.loader.weight_map`). `plugin`: True loads the folder's
        `ksana_plugin.py` if there is one, False never runs plugin code, a path loads that file
        (see `ksana_llm.api.plugin`); a hub repository's own `ksana_plugin.py` runs only with
        `trust_remote_code` (vLLM's rule for a repository's code), as does tokenizer code
        (a tokenizer_config.json `auto_map`: Baichuan's, Qwen v1's), local or not. `quantization` "fp8" keeps the projections' weights as FP8
        (per-row scales, quantized as they load), "w8a8_int8" as int8 with their inputs
        quantized to int8 per token; a quantized checkpoint loads as it is without it.

        `tokenizer`: a folder whose tokenizer replaces the model's own (vLLM's `tokenizer`;
        e.g. a weights-only folder, or a GGUF file whose embedded tokenizer is not wanted), or
        a hub id; `tokenizer_revision` (vLLM's) is its revision, or, without `tokenizer`, that
        of the model's hub repository's tokenizer. `hf_token` (vLLM's): the hub token that
        downloads use (None or True: huggingface_hub's own, HF_TOKEN or the stored login).
        `skip_tokenizer_init` (vLLM's): load none; the model then runs on token ids only
        (EOS ids still come from generation_config.json / config.json).

        `hf_overrides` (vLLM's): config.json values to change before the model is built, e.g.
        `{"max_position_embeddings": 65536, "rope_scaling": {...}}` (a dict for a sub-config
        such as `text_config` updates its keys); every rank applies them.

        `load_format` (vLLM's): "auto", "safetensors" or "pt" (only those files), "gguf" (the
        path must be a .gguf file), or "dummy": made-up weights of the config's shapes, for
        profiling without the real ones (`ksana_llm.loader.load_format`).

        `pad_token_id` (the KTransformers guide passes it): the paged engine never pads a batch,
        so it only names the tokenizer's pad token where the tokenizer has none.

        `tensor_parallel_size` > 1 (0: every visible GPU) or `pipeline_parallel_size` > 1 starts
        one worker process per extra rank; this process is rank 0. With KsanaLLM's multi-node
        variables set (WORLD_SIZE > 1, NODE_RANK 0, MASTER_HOST, MASTER_PORT) the nodes are the
        pipeline stages and the other nodes' ranks join from their own `ksana-llm serve`.
        """
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path must be a folder, a .gguf file or a hub id, got {path!r}")
        check_quantization(quantization)
        check_load_format(load_format, path)
        if skip_tokenizer_init and tokenizer is not None:
            raise ValueError("tokenizer: not with skip_tokenizer_init, which loads none")
        if tokenizer_revision is not None and tokenizer is None:
            if path is None or not names_a_hub_repo(path):
                raise ValueError(f"tokenizer_revision {tokenizer_revision!r} applies to Hugging "
                                 "Face hub ids; neither the model nor a tokenizer is one")
            tokenizer = path  # the model repository's tokenizer, at that revision
        if not isinstance(plugin, (bool, str, os.PathLike)):
            raise ValueError(f"plugin must be True, False or the path of a ksana_plugin.py, got {plugin!r}")
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        tp_size = resolve_parallel_size("tensor_parallel_size", tensor_parallel_size, torch_device)
        pp_size = resolve_parallel_size("pipeline_parallel_size", pipeline_parallel_size, None)
        model_dir = resolve_model_dir(path, revision=revision, download_dir=download_dir,
                                      token=hf_token)
        if hf_overrides is not None and not isinstance(hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict, got {type(hf_overrides).__name__}")
        hf_config = load_hf_config(model_dir, hf_overrides)
        # Before the weights: a wrong tokenizer path fails in seconds, not after the load.
        given_tokenizer = (None if tokenizer is None
                           else load_tokenizer(tokenizer, int(hf_config.vocab_size),
                                               download_dir=download_dir,
                                               revision=tokenizer_revision, token=hf_token,
                                               trust_remote_code=trust_remote_code))
        folder_tokenizer = None
        if classification_architecture(hf_config) \
                and getattr(hf_config, "classifier_from_token", None) is not None:
            # A reranker made a classifier (models.sequence_classification): its tokens are
            # looked up in the tokenizer it serves with, and the ids reach every rank's config.
            if given_tokenizer is None:
                folder_tokenizer = load_folder_tokenizer(
                    model_dir, trust_remote_code=trust_remote_code)
            ids = classifier_token_ids(hf_config, given_tokenizer or folder_tokenizer)
            hf_overrides = {**(hf_overrides or {}), TOKEN_IDS_KEY: ids}
            setattr(hf_config, TOKEN_IDS_KEY, ids)
        model_type = getattr(hf_config, "model_type", None)
        runtime, workers = None, []
        node = multi_node_env()
        if tp_size * pp_size > 1 or node is not None:
            check_parallel_sizes(model_dir, hf_config, tp_size, pp_size)
            spec = LaunchSpec(str(model_dir), str(torch_dtype).removeprefix("torch."),
                              torch_device.type, tp_size, pp_size, quantization=quantization,
                              hf_overrides=hf_overrides or None, load_format=load_format)
            runtime, workers = start_master(spec, node)
            torch_device = runtime.device
        try:
            module, _ = load_model_module(model_dir, device=torch_device, dtype=torch_dtype,
                                          parallel=None if runtime is None else runtime.ctx,
                                          progress=progress, hf_config=hf_config,
                                          quantization=quantization, load_format=load_format)
        except BaseException:
            stop_workers(workers)
            if runtime is not None:
                shutdown_runtime()
            raise
        model_cls = type(module)
        tokenizer = None if skip_tokenizer_init else given_tokenizer if given_tokenizer \
            is not None else folder_tokenizer or load_folder_tokenizer(
                model_dir, trust_remote_code=trust_remote_code)
        set_pad_token(tokenizer, pad_token_id, int(hf_config.vocab_size))
        logger.info("loaded %s (%s) on %s as %s", model_dir, model_cls.__name__, torch_device,
                    torch_dtype)
        loaded_plugin = None
        if plugin is True and not trust_remote_code and _came_from_the_hub(path):
            plugin = False
            if (Path(model_dir) / PLUGIN_FILENAME).is_file():
                logger.warning("%s ships a %s: not run, as it is the hub repository's own code "
                               "(trust_remote_code=True / --trust-remote-code runs it)",
                               path, PLUGIN_FILENAME)
        if plugin is not False:
            loaded_plugin = load_plugin(
                model_dir, model_type=str(model_type or ""),
                hidden_size=int(hf_config.hidden_size), vocab_size=int(hf_config.vocab_size),
                device=torch_device, dtype=torch_dtype,
                path=None if plugin is True else plugin)
        return cls(module, hf_config, tokenizer, Path(model_dir), torch_device, torch_dtype,
                   find_eos_token_ids(Path(model_dir), hf_config, tokenizer), loaded_plugin,
                   runtime, workers, load_format, quantization)


def _came_from_the_hub(path: Any) -> bool:
    """Whether `path` named a hub repository (resolved to a snapshot), not a local folder."""
    return path is not None and names_a_hub_repo(path)  # (None: the embedded default model)
