"""Sleep mode (vLLM's): a runner gives its device memory back while the engine idles (an RL
trainer needs the GPU between rollouts), and takes it again on waking.

- level 1: the KV cache is freed (its contents are lost: the engine empties the prefix cache
  first); the weights are copied to host memory and their device memory freed -- on a CPU
  device they are in host memory already and stay where they are.
- level 2: the KV cache and the weights are freed; waking gives the weights memory back, but
  not their values: load them again (`Engine.update_weights`) before serving.

Tensors keep their identity (their storage is resized to nothing and back), so every module,
view and block table stays valid; captured CUDA graphs, which hold device addresses, are
captured again on waking. Only parameters sleep: buffers (RoPE tables, router biases) are
small and some are computed, not loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ksana_llm.layers.attention import KVCache

logger = logging.getLogger("ksana_llm.runner")

SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")


def check_sleep_level(level: object) -> int:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"level must be 1 (offload the weights, free the KV cache) or 2 (free "
                         f"both), got {level!r}")
    return int(level)  # type: ignore[arg-type]


def check_wake_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """The parts to wake: `tags` (a subset of "weights", "kv_cache"), or both for None."""
    if tags is None:
        return SLEEP_TAGS
    if isinstance(tags, str):
        tags = [tags]
    chosen = tuple(dict.fromkeys(tags))
    unknown = [tag for tag in chosen if tag not in SLEEP_TAGS]
    if unknown or not chosen:
        raise ValueError(f"tags must name some of {', '.join(SLEEP_TAGS)}, got {list(tags)}")
    return chosen


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """(a tensor on each distinct storage, the storage's size in bytes): tied weights and the K
    and V views of one allocation are freed once."""
    seen: dict[int, tuple[torch.Tensor, int]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (tensor, storage.nbytes())
    return list(seen.values())


class SleepMode:
    """Mixed into `ModelRunner`, which provides `model`, `device`, `kv_caches`,
    `draft_kv_caches`, `decode_graphs` and `setup_cuda_graphs`."""

    model: nn.Module
    device: torch.device
    kv_caches: list[KVCache]
    draft_kv_caches: list[KVCache]
    decode_graphs: object

    def setup_cuda_graphs(self, sizes: Sequence[int], *, capture: bool = True) -> None:  # pragma: no cover
        raise NotImplementedError

    # What sleeps now: tensor and its storage's size in bytes, per part.
    _sleeping_kv: list[tuple[torch.Tensor, int]] | None = None
    _sleeping_weights: list[tuple[torch.Tensor, int, torch.Tensor | None]] | None = None
    # Level 2 freed the weights' values: the next weight update must bring them.
    weights_discarded: bool = False

    @property
    def asleep(self) -> tuple[str, ...]:
        """The parts asleep now ("weights", "kv_cache")."""
        return tuple(tag for tag, part in zip(SLEEP_TAGS, (self._sleeping_weights,
                                                            self._sleeping_kv))
                     if part is not None)

    def sleep(self, level: int) -> None:
        level = check_sleep_level(level)
        if self._sleeping_kv is None:
            caches = [t for pair in self.kv_caches + self.draft_kv_caches for t in pair]
            self._sleeping_kv = _unique_storages(caches)
            for tensor, _ in self._sleeping_kv:
                tensor.untyped_storage().resize_(0)
        if self._sleeping_weights is None and (level == 2 or self.device.type != "cpu"):
            sleeping = []
            # Level 1 keeps the values on the host (pinned memory: a fast copy back).
            pin = self.device.type == "cuda" and torch.cuda.is_available()
            for tensor, nbytes in _unique_storages(self.model.parameters()):
                copy = None if level == 2 else torch.empty(
                    nbytes, dtype=torch.uint8, pin_memory=pin).copy_(_storage_bytes(tensor))
                sleeping.append((tensor, nbytes, copy))
                tensor.untyped_storage().resize_(0)
            self._sleeping_weights = sleeping
            self.weights_discarded = level == 2
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # back to the driver: another process may take it

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        chosen = check_wake_tags(tags)
        woke = False
        if "weights" in chosen and self._sleeping_weights is not None:
            for tensor, nbytes, copy in self._sleeping_weights:
                tensor.untyped_storage().resize_(nbytes)
                if copy is not None:
                    _storage_bytes(tensor).copy_(copy)
            self._sleeping_weights = None
            woke = True
        if "kv_cache" in chosen and self._sleeping_kv is not None:
            for tensor, nbytes in self._sleeping_kv:
                tensor.untyped_storage().resize_(nbytes)
                _storage_bytes(tensor).zero_()  # as allocated: padding reads must see zeros
            self._sleeping_kv = None
            woke = True
        graphs = self.decode_graphs
        if woke and graphs is not None and self.device.type == "cuda":
            # The storages came back at other addresses: the captured graphs read the old ones.
            logger.info("capturing the CUDA graphs again after waking")
            self.setup_cuda_graphs(graphs.sizes)


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under `tensor`, as a flat uint8 tensor."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
