"""KsanaLLM plugins: a `ksana_plugin.py` in the model folder, defining a class `KsanaPlugin`.

The class may define three methods, all optional, all called with keyword arguments only:
- `init_plugin(**kwargs)`, once at load: `preprocess=True, postprocess=True, model_path,
  config_file, enable_trt, model_type, vit_model_type`. If it raises (or the file cannot be
  imported, or has no `KsanaPlugin`), the plugin is disabled with a warning and the model serves
  without it -- KsanaLLM's rule.
- `preprocess(**kwargs)`, once per request before prefill: `ksana_python_input` (a mutable
  `KsanaPythonInput`: `input_tokens`, `input_refit_embedding.pos / embeddings /
  embedding_tensors`, `sampling_config`), `prompt`, `messages`, `additional_params`. It may
  rewrite the tokens and place input embeddings (image features, ...) at given positions.
- `postprocess(**kwargs)`, once per request before its final output is delivered:
  `ksana_python_input` and `ksana_python_output` (a mutable `KsanaPythonOutput`; any attribute it
  sets that is not one of the output's own fields lands in `RequestOutput.extra`).

Input embeddings follow KsanaLLM: `pos[i]` is where block `i` starts, and block `i` (a float list,
a tensor, or a list of rows) holds `k * hidden_size` numbers that replace the token embeddings at
positions `pos[i] .. pos[i] + k - 1`. `embedding_tensors`, when set, is used instead of
`embeddings` (plugins set tensors to skip the list conversion).

Plugin calls are serialised by a lock (KsanaLLM runs them on a pool of `plugin_thread_pool_size`
threads, 1 by default, so plugins need not be thread-safe), and on a GPU they run on a side CUDA
stream that is synchronised before the results are used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from ksana_llm.generation_config import GenerationConfig

if TYPE_CHECKING:
    from ksana_llm.api.outputs import RequestOutput

logger = logging.getLogger("ksana_llm.plugin")

PLUGIN_FILENAME = "ksana_plugin.py"
PLUGIN_CLASS = "KsanaPlugin"

# Positions and rows of input embeddings, as the engine's Request carries them.
InputEmbeddings = tuple[list[int], torch.Tensor]


class PluginError(RuntimeError):
    """The plugin's preprocess failed with something other than a ValueError (which means the
    plugin rejected the request's input and is passed through as is)."""


@dataclass
class RefitEmbedding:
    """KsanaLLM's `input_refit_embedding`: embedding blocks and where each one starts."""

    pos: list[int] = field(default_factory=list)
    embeddings: list[Any] = field(default_factory=list)
    embedding_tensors: list[Any] = field(default_factory=list)
    # KsanaLLM passes model-specific extras here (Qwen2-VL's mrope positions); kept so plugins
    # written for it run, but no model of ours reads them yet.
    additional_tensors: list[Any] = field(default_factory=list)


# KsanaLLM's SamplingConfig names -> ours, so plugins written for KsanaLLM keep working.
_SAMPLING_ALIASES = {"topk": "top_k", "topp": "top_p", "logprobs_num": "logprobs",
                     "stop_strings": "stop"}


class SamplingConfigView:
    """The request's GenerationConfig (a private copy) under both our and KsanaLLM's field names.
    Setting an unknown name raises AttributeError, so a plugin's typo does not pass silently."""

    def __init__(self, config: GenerationConfig) -> None:
        object.__setattr__(self, "_config", config)

    def _name(self, name: str) -> str:
        name = _SAMPLING_ALIASES.get(name, name)
        if name not in {f.name for f in dataclasses.fields(GenerationConfig)}:
            raise AttributeError(f"sampling_config has no field {name!r}")
        return name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, self._name(name))

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._config, self._name(name), value)

    def __repr__(self) -> str:
        return f"SamplingConfigView({self._config!r})"


@dataclass
class KsanaPythonInput:
    """What `preprocess` may change (and `postprocess` sees again)."""

    input_tokens: list[int]
    sampling_config: SamplingConfigView
    input_refit_embedding: RefitEmbedding = field(default_factory=RefitEmbedding)
    model_name: str = ""


_OUTPUT_FIELDS = frozenset({"request_id", "input_tokens", "output_tokens", "texts",
                            "finish_reason", "logprobs", "extra"})


@dataclass
class KsanaPythonOutput:
    """A request's final result as `postprocess` sees it: one entry per returned sequence in
    `output_tokens` / `texts` / `logprobs` (KsanaLLM's shape). Only `extra` travels back to the
    caller: `output.ppl = 3.2` or `output.extra["ppl"] = 3.2` both give `RequestOutput.extra["ppl"]`.
    The other fields are copies; changing them changes nothing the caller sees (streamed text has
    already gone out by the time postprocess runs)."""

    request_id: str
    input_tokens: list[int]
    output_tokens: list[list[int]]
    texts: list[str]
    finish_reason: str | None
    logprobs: list[Any] | None
    extra: dict[str, Any] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OUTPUT_FIELDS:
            object.__setattr__(self, name, value)
        else:
            self.extra[name] = value

    def __getattr__(self, name: str) -> Any:  # only reached for names that are not attributes
        extra = self.__dict__.get("extra")
        if extra is not None and name in extra:
            return extra[name]
        raise AttributeError(f"KsanaPythonOutput has no field {name!r}")


@dataclass(frozen=True)
class PreprocessResult:
    """What the engine builds the request from after `preprocess`. Keep it and pass it to
    `run_postprocess`, which hands the same `python_input` to the plugin again."""

    token_ids: list[int]
    generation_config: GenerationConfig
    input_embeddings: InputEmbeddings | None
    python_input: KsanaPythonInput


class Plugin:
    """A loaded, initialised `KsanaPlugin` and the two calls the engine makes on it."""

    def __init__(self, instance: Any, path: Path, *, hidden_size: int, vocab_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.instance = instance
        self.path = path
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = dtype
        self.has_preprocess = callable(getattr(instance, "preprocess", None))
        self.has_postprocess = callable(getattr(instance, "postprocess", None))
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __repr__(self) -> str:
        return f"Plugin({self.path})"

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """One plugin call at a time, on the side stream; results are complete on exit."""
        with self._lock:
            if self._stream is None:
                yield
                return
            # The side stream must see everything already queued on the default stream.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(self._stream):
                    yield
            finally:
                self._stream.synchronize()

    # ---- per request, before prefill (caller's thread) -----------------------------------------
    def run_preprocess(self, token_ids: list[int], *, generation_config: GenerationConfig,
                       prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                       input_embeddings: InputEmbeddings | None = None,
                       additional_params: dict[str, Any] | None = None) -> PreprocessResult:
        """Run the plugin's `preprocess` on one request and return what to build it from.

        Takes the prompt's token ids (already tokenized), the prompt text if there was one, the
        request's resolved GenerationConfig (not modified: the plugin gets a copy), the request's
        own input embeddings `(absolute positions, [P, hidden] rows)` if any, and its
        `additional_params`. Builds KsanaLLM's kwargs (`ksana_python_input`, `prompt`, `messages`,
        `additional_params`), calls `preprocess`, and returns the possibly changed token ids,
        GenerationConfig (validated again) and input embeddings (absolute positions and a
        `[P, hidden]` tensor in the model's dtype on its device, or None).

        Raises ValueError naming the field when the plugin leaves invalid tokens, embeddings or
        settings behind (or itself raises ValueError to reject the request's input), and
        PluginError when it fails in any other way.
        """
        config = generation_config.replace()  # a deep copy: the plugin may change it
        refit = RefitEmbedding()
        if input_embeddings is not None:
            positions, rows = input_embeddings
            refit.pos = [int(p) for p in positions]
            refit.embeddings = list(rows.unbind(0))
        python_input = KsanaPythonInput(list(token_ids), SamplingConfigView(config), refit)
        if self.has_preprocess:
            kwargs = {"ksana_python_input": python_input, "prompt": prompt, "messages": messages,
                      "additional_params": dict(additional_params or {})}
            try:
                with self._calling():
                    self.instance.preprocess(**kwargs)
            except ValueError:
                raise
            except Exception as exc:  # any other plugin failure fails this request only
                raise PluginError(f"plugin {self.path} preprocess failed: {exc!r}") from exc
        tokens = self._checked_tokens(python_input.input_tokens)
        config.validate()  # as the plugin left it; the copy normalises a lone stop string
        config = config.replace()
        embeddings = self._collect_embeddings(python_input.input_refit_embedding, len(tokens))
        return PreprocessResult(tokens, config, embeddings, python_input)

    def _checked_tokens(self, tokens: Any) -> list[int]:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        what = "ksana_python_input.input_tokens"
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise ValueError(f"{what} must be a non-empty list of token ids after preprocess")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ValueError(f"{what} must hold integers after preprocess")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} must be in [0, {self.vocab_size}); got {bad[:5]}")
        return list(tokens)

    def _collect_embeddings(self, refit: RefitEmbedding, num_tokens: int) -> InputEmbeddings | None:
        """KsanaLLM blocks (start position + k rows each) -> absolute positions and rows."""
        what = "ksana_python_input.input_refit_embedding"
        blocks = list(refit.embedding_tensors) if len(refit.embedding_tensors) else list(refit.embeddings)
        starts = list(refit.pos)
        if not starts and not blocks:
            return None
        if len(starts) != len(blocks):
            raise ValueError(f"{what}: {len(starts)} positions in pos but {len(blocks)} embeddings")
        positions: list[int] = []
        rows: list[torch.Tensor] = []
        for start, block in zip(starts, blocks):
            if isinstance(start, bool) or not isinstance(start, int):
                raise ValueError(f"{what}.pos must hold integers, got {start!r}")
            tensor = block if isinstance(block, torch.Tensor) else torch.as_tensor(block, dtype=torch.float32)
            if tensor.numel() == 0 or tensor.numel() % self.hidden_size:
                raise ValueError(f"{what}: the block at pos {start} has {tensor.numel()} numbers, "
                                 f"not a multiple of hidden_size {self.hidden_size}")
            tensor = tensor.reshape(-1, self.hidden_size)
            end = start + tensor.shape[0]
            if start < 0 or end > num_tokens:
                raise ValueError(f"{what}: the block at pos {start} covers positions [{start}, {end}), "
                                 f"outside the {num_tokens} input tokens")
            positions.extend(range(start, end))
            rows.append(tensor.detach().to(self.device, self.dtype))
        if len(set(positions)) != len(positions):
            raise ValueError(f"{what}: embedding blocks overlap")
        return positions, torch.cat(rows)

    # ---- per request, before its final output (engine thread) ---------------------------------
    def run_postprocess(self, request_info: PreprocessResult | None, output: RequestOutput) -> None:
        """Run the plugin's `postprocess` on a finished request; fields it adds go to
        `output.extra`. `request_info` is what `run_preprocess` returned for this request (None
        if it did not run: the plugin then sees the prompt tokens and the default settings).
        Never raises: a failing postprocess is logged and the output is delivered as it was, so
        a plugin bug cannot take down the engine thread."""
        if not self.has_postprocess:
            return
        if request_info is not None:
            python_input = request_info.python_input
        else:
            python_input = KsanaPythonInput(list(output.prompt_token_ids),
                                            SamplingConfigView(GenerationConfig()))
        python_output = KsanaPythonOutput(
            request_id=output.request_id, input_tokens=list(output.prompt_token_ids),
            output_tokens=[list(s.token_ids) for s in output.sequences],
            texts=[s.text for s in output.sequences], finish_reason=output.finish_reason,
            logprobs=None if output.logprobs is None else [
                None if s.logprobs is None else list(s.logprobs) for s in output.sequences])
        try:
            with self._calling():
                self.instance.postprocess(ksana_python_input=python_input,
                                          ksana_python_output=python_output)
        except Exception:  # see the docstring: never into the engine thread
            logger.exception("plugin %s postprocess failed for request %s; output left as is",
                             self.path, output.request_id)
            return
        output.extra.update(python_output.extra)


# ---- loading -------------------------------------------------------------------------------------

def find_plugin_file(model_dir: str | os.PathLike[str]) -> Path | None:
    candidate = Path(model_dir) / PLUGIN_FILENAME
    return candidate if candidate.is_file() else None


def import_source_file(path: Path, prefix: str) -> ModuleType:
    """Import a Python file as a module named `prefix` + a hash of its path (two files, or a
    file named like a package, never clash). The module is registered in sys.modules before it
    runs, as dataclasses and pickling inside it expect; ImportError if it is no Python file,
    and whatever the file raises as it runs."""
    name = prefix + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _import_plugin_class(path: Path) -> Any:
    """Import the file and return its KsanaPlugin class."""
    module = import_source_file(path, "ksana_plugin_")
    cls = getattr(module, PLUGIN_CLASS, None)
    if cls is None:
        raise ImportError(f"{path} defines no class {PLUGIN_CLASS}")
    return cls


def load_plugin(model_dir: str | os.PathLike[str], *, model_type: str, hidden_size: int,
                vocab_size: int, device: torch.device, dtype: torch.dtype,
                path: str | os.PathLike[str] | None = None, config_file: str = "") -> Plugin | None:
    """Find (`path`, else `<model_dir>/ksana_plugin.py`), import, instantiate and initialise the
    plugin. None when there is none, or when any of those steps fails (logged as a warning)."""
    plugin_path = Path(path) if path is not None else find_plugin_file(model_dir)
    if plugin_path is None:
        return None
    if not plugin_path.is_file():
        raise FileNotFoundError(f"plugin file not found: {plugin_path}")
    try:
        instance = _import_plugin_class(plugin_path)()
    except Exception as exc:  # noqa: BLE001 - a broken plugin disables the plugin, not the model
        logger.warning("plugin %s could not be loaded (%r); serving without it", plugin_path, exc)
        return None
    init = getattr(instance, "init_plugin", None)
    if callable(init):
        kwargs = {"preprocess": True, "postprocess": True, "model_path": str(model_dir),
                  "config_file": config_file, "enable_trt": False, "model_type": model_type,
                  "vit_model_type": ""}
        try:
            init(**kwargs)
        except Exception as exc:  # noqa: BLE001 - KsanaLLM's rule: a failed init disables it
            logger.warning("plugin %s: init_plugin failed (%r); serving without the plugin",
                           plugin_path, exc)
            return None
    logger.info("plugin %s loaded (preprocess: %s, postprocess: %s)", plugin_path,
                callable(getattr(instance, "preprocess", None)),
                callable(getattr(instance, "postprocess", None)))
    return Plugin(instance, plugin_path, hidden_size=hidden_size, vocab_size=vocab_size,
                  device=device, dtype=dtype)
