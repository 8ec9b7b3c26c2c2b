"""Updating a loaded model's weights in place, while it serves (an RL trainer's weight sync:
vLLM's `model.load_weights`, SGLang's `update_weights_from_disk` / `_from_tensor`).

Two phases, so that an update that does not fit changes nothing: `check_update` sends every
tensor through the model's own loading code into a *meta twin* of the module (the same modules
and attributes, the weights on the meta device): each name must find its parameter, each shape
must fit, fused projections, expert stacks, tensor-parallel slices and weight maps included,
and no parameter may be replaced (another format) -- without a weight's values being read or
written (a checkpoint folder's matrices are not even read from disk, unless it is quantized). Only then does `apply_update` copy the tensors into the live parameters, in place, so
CUDA graphs captured on them stay valid. A subset of the tensors may be given: the others keep
their values.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ksana_llm.loader import load_hf_config, resolve_model_dir
from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.models.factory import checkpoint_tensors, renamed_by_weight_map
from ksana_llm.models.weight_loading import with_base_model_prefix


@dataclass(frozen=True)
class WeightUpdate:
    """One update, as every rank receives it: a checkpoint folder each rank reads itself, or
    tensors under their checkpoint names (renamed by the model's weight map already)."""

    folder: str | None = None
    tensors: tuple[tuple[str, torch.Tensor], ...] = ()

    def stream(self, shapes_only: bool = False) -> Iterator[tuple[str, Any]]:
        """The update's tensors under their checkpoint names; a fresh pass each call.
        `shapes_only` (the check): a folder's matrices may come as meta tensors, unread."""
        if self.folder is None:
            return iter(self.tensors)
        return checkpoint_tensors(self.folder, load_hf_config(self.folder), progress=False,
                                  shapes_only=shapes_only)

    def named_for(self, module: nn.Module, tensors: Iterable[tuple[str, Any]]
                  ) -> Iterator[tuple[str, Any]]:
        """`tensors` (from `stream`) as `module.load_weights` takes them: a base model's names
        ("layers.0. ...", a trainer's `model.model.state_dict()`) get the `model.` prefix, as
        at load. A folder is a whole checkpoint: with no LM head, its embedding stands in, as
        at load; tensors given outright may be a part, so a head they lack keeps its values."""
        return with_base_model_prefix(module, tensors,
                                      head_from_embedding=self.folder is not None)


def weight_update(weights: Any, model_dir: str | os.PathLike, hf_config: Any) -> WeightUpdate:
    """The update `Engine.update_weights(weights)` asks for: a checkpoint folder (a path) of the
    same model type as `hf_config`, or tensors as a mapping (a state dict) or (name, tensor)
    pairs, renamed by the weight map `model_dir` uses. ValueError naming `weights` otherwise."""
    if isinstance(weights, (str, os.PathLike)):
        folder = Path(weights).expanduser()
        if (folder.is_file() and folder.suffix.lower() == ".gguf") or \
                (folder.is_dir() and not (folder / "config.json").is_file()):
            # A GGUF file (the default model is one), or a folder holding one: its converted,
            # cached checkpoint folder, as Model.from_pretrained loads it.
            try:
                folder = resolve_model_dir(folder)
            except (OSError, ValueError) as exc:
                raise ValueError(f"weights: {exc}") from exc
        if not folder.is_dir():
            raise ValueError(f"weights: {str(weights)!r} is not a checkpoint folder or a GGUF "
                             "file")
        try:
            theirs = getattr(load_hf_config(folder), "model_type", None)
        except (OSError, ValueError) as exc:
            raise ValueError(f"weights: cannot read the config of {folder}: {exc}") from exc
        ours = getattr(hf_config, "model_type", None)
        if theirs != ours:
            raise ValueError(f"weights: {folder} holds a {theirs!r} model, this engine serves "
                             f"a {ours!r} one")
        return WeightUpdate(folder=str(folder))
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    if isinstance(pairs, (bytes, torch.Tensor)) or not isinstance(pairs, Iterable):
        raise ValueError("weights must be a checkpoint folder, a dict of name -> tensor or "
                         f"(name, tensor) pairs, got {type(weights).__name__}")
    tensors = []
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"weights: expected (name, tensor) pairs, got {_describe(item)}")
        name, tensor = item
        if tensor.is_meta or tensor.is_sparse:
            raise ValueError(f"weights: tensor {name!r} holds no dense values")
        tensors.append((name, tensor.detach()))
    if not tensors:
        raise ValueError("weights: no tensors given")
    seen: set[str] = set()
    for name, _ in tensors:
        if name in seen:
            raise ValueError(f"weights: tensor {name!r} is given twice")
        seen.add(name)
    return WeightUpdate(tensors=tuple(renamed_by_weight_map(tensors, model_dir, hf_config)))


def _describe(item: Any) -> str:
    if isinstance(item, tuple):
        return "(" + ", ".join(type(part).__name__ for part in item) + ")"
    return type(item).__name__


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of `module` whose weights hold no memory: parameters, buffers and tensor
    attributes become meta tensors of the same shapes and dtypes (vectors and index tensors
    become real copies: small, and loading code may read them, e.g. GPTQ input orders).
    Containers (dicts, lists, sets: loading code records per-stack state in them) are copied;
    other objects (configs, parallel contexts, functions) are shared, as the dry run only
    reads them."""
    memo: dict[int, Any] = {}

    def map_tensors(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            memo.setdefault(id(value), _twin_tensor(value))
        elif isinstance(value, dict):
            for item in value.values():
                map_tensors(item)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                map_tensors(item)

    for sub in module.modules():
        for key, value in vars(sub).items():
            if key == "_modules" or isinstance(value, nn.Module):
                continue  # copied as modules, their own tensors mapped in their turn
            map_tensors(value)
            if not isinstance(value, (torch.Tensor, dict, list, tuple, set, frozenset)):
                memo.setdefault(id(value), value)
    return copy.deepcopy(module, memo)


def _twin_tensor(tensor: torch.Tensor) -> torch.Tensor:
    # Real copies of what loading code may read: vectors, and index tensors (input orders of
    # stacked experts) -- small next to the weights.
    small = tensor.dim() <= 1 or tensor.dtype in (torch.int32, torch.int64)
    if small and tensor.layout == torch.strided:
        twin = tensor.detach().clone()
    else:  # shape and dtype only (a prepacked oneDNN copy has no meta form of its layout)
        twin = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(twin, requires_grad=tensor.requires_grad)
    return twin


def _meta_tensor(tensor: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
    """What the dry run loads: the tensor's shape and dtype, none of its values -- except for
    vectors (biases, norms: small), whose values may decide where they go (an all-zero bias a
    projection without one may drop, `weight_loading._spare_zero_bias`), and a quantized
    weight's scales, zero points and input order (a group's worth of values each, which it
    checks as it is made)."""
    if isinstance(tensor, QuantizedWeight):
        return replace(tensor, data=_meta_tensor(tensor.data))
    if tensor.dim() <= 1:
        return tensor
    return torch.empty_like(tensor, device="meta")


def _counted(weights: Iterable[tuple[str, Any]], convert: Callable[[Any], Any],
             count: list[int]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        count[0] += 1
        yield name, convert(tensor)


@dataclass(frozen=True)
class CheckedUpdate:
    num_tensors: int
    filled: frozenset[str]  # the model's checkpoint keys the update sets (`expected_keys`)


def check_update(module: nn.Module, update: WeightUpdate) -> CheckedUpdate:
    """Load `update` into a meta twin of `module`: a ValueError naming the first tensor without
    a place or of the wrong shape, or a parameter the update would replace rather than fill
    (another format: dense tensors for a quantized checkpoint's projections); what it holds
    otherwise. The module is not touched."""
    count = [0]
    twin = meta_twin(module)
    before = dict(_tensors_by_name(twin))
    tensors = _counted(update.stream(shapes_only=True), _meta_tensor, count)
    filled = twin.load_weights(update.named_for(twin, tensors), require_all=False)
    if count[0] == 0:  # (tensors given outright were checked for this already)
        # An empty or half-written checkpoint: "updated" would be a lie.
        raise ValueError(f"weights: {update.folder} holds no tensors")
    after = dict(_tensors_by_name(twin))
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if old is not new:
            raise ValueError(f"weights: loading them would replace {name} "
                             f"({_describe_tensor(old)}) by {_describe_tensor(new)}: an update "
                             "keeps the model's format (a quantized checkpoint's projections "
                             "take tensors quantized the same way)")
    return CheckedUpdate(count[0], frozenset(filled))


def _tensors_by_name(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _describe_tensor(tensor: torch.Tensor | None) -> str:
    return "nothing" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"


def apply_update(module: nn.Module, update: WeightUpdate) -> None:
    """Copy `update` (checked by `check_update`) into `module`'s parameters, in place."""
    with torch.no_grad():
        module.load_weights(update.named_for(module, update.stream()), require_all=False)
