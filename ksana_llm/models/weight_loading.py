"""Copying checkpoint tensors (Hugging Face names) into a model's parameters.

One loader for every family. A checkpoint tensor lands in one of three ways:
- a submodule that defines `load_checkpoint_tensor(local_name, tensor) -> list[str]` takes every
  tensor under its prefix and returns the keys it filled (MoE experts stacked into one tensor,
  MLA's absorbed projections, ...); it lists what it expects in `expected_checkpoint_keys()`;
- a part of a fused projection (`q_proj` into `qkv_proj`, ...) goes through
  `MergedLinear.load_shard`;
- anything else is copied into the parameter of the same name, shapes checked.
At the end every expected key must have been filled, so a checkpoint that lacks a tensor fails
loudly instead of serving random weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ksana_llm.layers.linear import MergedLinear
from ksana_llm.loader.quantized_weight import QuantizedWeight, dense

logger = logging.getLogger("ksana_llm.model")


def _custom_loaders(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules()
            if name and hasattr(module, "load_checkpoint_tensor")}


def _owner(name: str, loaders: Mapping[str, nn.Module]) -> str | None:
    """The longest module prefix of `name` with a custom loader."""
    best = None
    for prefix in loaders:
        if name.startswith(prefix + ".") and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def expected_keys(model: nn.Module) -> set[str]:
    loaders = _custom_loaders(model)
    keys: set[str] = set()
    for prefix, module in loaders.items():
        keys.update(f"{prefix}.{key}" for key in module.expected_checkpoint_keys())
    for pname, _ in model.named_parameters():
        if _owner(pname, loaders) is not None:
            continue
        module = model.get_submodule(pname.rsplit(".", 1)[0])
        if isinstance(module, MergedLinear):
            keys.update(f"{pname}#{i}" for i in range(len(module.out_sizes)))
        else:
            keys.add(pname)
    return keys


def _spare_zero_bias(name: str, tensor: torch.Tensor | QuantizedWeight) -> bool:
    """An all-zero bias, which may come for a projection that has none: AutoGPTQ's older
    checkpoints store one for every quantized projection, bias-free ones included (adding zeros
    is a no-op, so it needs no place)."""
    return (name == "bias" or name.endswith(".bias")) and isinstance(tensor, torch.Tensor) \
        and not tensor.any()


def place_tensor(model: nn.Module, name: str, tensor: torch.Tensor | QuantizedWeight,
                 fused_parts: Mapping[str, tuple[str, int]],
                 loaders: Mapping[str, nn.Module] | None = None) -> list[str]:
    """Put one checkpoint tensor where it belongs in `model`; the keys it filled. A quantized
    weight (`QuantizedWeight`) goes as it is to the projections, which keep it quantized, and
    dequantized anywhere else."""
    loaders = _custom_loaders(model) if loaders is None else loaders
    prefix = _owner(name, loaders)
    if prefix is not None:
        loader = loaders[prefix]
        local = name[len(prefix) + 1:]
        if _spare_zero_bias(local, tensor) and local not in loader.expected_checkpoint_keys():
            return []
        if not getattr(loader, "takes_quantized_weights", False):
            tensor = dense(tensor)
        try:
            filled = loader.load_checkpoint_tensor(local, tensor)
        except ValueError as exc:  # the loader knows only its local name: give the whole one
            raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc
        return [f"{prefix}.{key}" for key in filled]
    target, part = name, None
    for ckpt_part, (fused, index) in fused_parts.items():
        if f".{ckpt_part}." in f".{name}":
            target, part = f".{name}".replace(f".{ckpt_part}.", f".{fused}.")[1:], index
            break
    try:
        param = model.get_parameter(target)
    except AttributeError:
        if _spare_zero_bias(name, tensor):
            return []
        raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}") from None
    # No dtype conversion here: `copy_` converts, after a tensor-parallel shard is sliced, so a
    # rank never converts (or, through safetensors' memory map, reads) more than its slice.
    owner = model.get_submodule(target.rsplit(".", 1)[0])
    if part is None and isinstance(owner, MergedLinear):
        # A checkpoint that stores the projections already fused (Qwen v1 `c_attn`, Baichuan
        # `W_pack`, through their weight maps): split it into its parts, so that each part is
        # checked and, under tensor parallelism, sharded like a separately stored one.
        if len(tensor.shape) != param.dim() or tensor.shape[0] != sum(owner.full_sizes):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected "
                             f"{sum(owner.full_sizes)} rows (parts {owner.full_sizes})")
        pieces = tensor.split_rows(owner.full_sizes) if isinstance(tensor, QuantizedWeight) \
            else tensor.split(owner.full_sizes, dim=0)
        for index, piece in enumerate(pieces):
            _load_shard(owner, param, piece, index, name)
        return [f"{target}#{i}" for i in range(len(owner.full_sizes))]
    if part is None:
        tensor = dense(tensor)
        if tensor.shape != param.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        return [target]
    _load_shard(owner, param, tensor, part, name)
    return [f"{target}#{part}"]


def _load_shard(owner: nn.Module, param: nn.Parameter, tensor: torch.Tensor | QuantizedWeight,
                part: int, name: str) -> None:
    """`owner.load_shard`, its errors naming the checkpoint tensor (it knows only the part)."""
    try:
        owner.load_shard(param, tensor, part)
    except ValueError as exc:
        raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    fused_parts: Mapping[str, tuple[str, int]],
                    skip: Callable[[str], bool] = lambda name: False, *,
                    require_all: bool = True) -> set[str]:
    """Load HF-named tensors into `model`; `fused_parts` maps a checkpoint part name (`q_proj`)
    to (fused parameter module name, part index); `skip(name)` drops tensors we compute
    ourselves (RoPE tables) or do not use. `require_all` False loads a subset (a weight update:
    the tensors not given keep their values). The keys filled (see `expected_keys`)."""
    loaders = _custom_loaders(model)
    loaded: dict[str, str] = {}  # key filled -> the checkpoint tensor that filled it
    for name, tensor in weights:
        if skip(name):
            continue
        for key in place_tensor(model, name, tensor, fused_parts, loaders):
            # Two tensors for one weight (a fused qkv_proj beside q/k/v_proj, stacked experts
            # beside per-expert ones): whichever came last would win, silently.
            if key in loaded:
                raise ValueError(f"checkpoint tensors {loaded[key]!r} and {name!r} both hold "
                                 f"{key}; keep one")
            loaded[key] = name
    missing = sorted(expected_keys(model) - set(loaded)) if require_all else []
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
    return set(loaded)


def with_base_model_prefix(model: nn.Module, weights: Iterable[tuple[str, Any]],
                           head_from_embedding: bool = True) -> Iterator[tuple[str, Any]]:
    """`weights` with the `model.` prefix on the names of a checkpoint saved from the base model
    (transformers' `Qwen3Model` rather than `Qwen3ForCausalLM`, as Qwen3-Embedding ships:
    "embed_tokens.weight", "layers.0. ..."), which transformers' `base_model_prefix` rule loads
    too. Such a checkpoint stores no LM head: an untied model's head is then the embedding,
    with a warning (transformers leaves it random), so its hidden states (embeddings, scores)
    are exact and its generated text is not the model's. Not with `head_from_embedding` off
    (an update given as tensors, which may be a part of the model: a missing head is kept)."""
    base = getattr(model, "model", None)
    if not isinstance(base, nn.Module):
        yield from weights
        return
    outer = {name for name, _ in model.named_children()}
    inner = {name for name, _ in base.named_children()}
    prefixed = head_seen = False
    embedding = None
    for name, tensor in weights:
        first = name.split(".", 1)[0]
        if first not in outer and first in inner:
            name, prefixed = f"model.{name}", True
        if name == "model.embed_tokens.weight":
            embedding = tensor
        head_seen = head_seen or name == "lm_head.weight"
        yield name, tensor
    if head_from_embedding and prefixed and not head_seen and embedding is not None \
            and "lm_head" in outer:
        logger.warning("the checkpoint is a base model's (no LM head): its embedding stands in "
                       "for the LM head; embeddings and scores are exact, generated text is not")
        yield "lm_head.weight", embedding
