"""Sleep mode (vLLM's): a runner gives its device memory back while the engine idles (an RL
trainer needs the GPU between rollouts), and takes it again on waking.

- level 1: the KV cache is freed (its contents are lost: the engine empties the prefix cache
  first); the weights are copied to host memory and their device memory freed -- on a CPU
  device they are in host memory already and stay where they are.
- level 2: the KV cache and the weights are freed; waking gives the weights memory back, but
  not their values: load them again (`Engine.update_weights`, all of them, in one call or
  several) before serving.
- LoRA adapter slots sleep with the weights (at either level): their device stacks are freed,
  and on waking the adapters that were in them are copied in again from their host copies.

Tensors keep their identity (their storage is resized to nothing and back), so every module,
view and block table stays valid; captured CUDA graphs, which hold device addresses, are
dropped on sleeping and captured again once every part is awake. Only parameters sleep: buffers (RoPE tables, router biases) are
small and some are computed, not loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ksana_llm.layers.attention import KVCache
from ksana_llm.models.weight_loading import expected_keys

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
    lora: Any = None  # its LoraSlots (none without LoRA)
    kv_caches: list[KVCache]
    draft_kv_caches: list[KVCache]
    host_caches: list[KVCache]
    decode_graphs: Any
    cuda_graph_status: str

    def setup_cuda_graphs(self, sizes: Sequence[int], *, capture: bool = True) -> None:  # pragma: no cover
        raise NotImplementedError

    # What sleeps now: tensor and its storage's size in bytes, per part.
    _sleeping_kv: list[tuple[torch.Tensor, int]] | None = None
    # The LoRA slots' stacks sleep with the weights; their contents are copied in again from
    # the adapters' host copies on waking (no copy of the stacks is kept).
    _sleeping_lora: list[tuple[torch.Tensor, int]] | None = None
    _sleeping_weights: list[tuple[torch.Tensor, int, torch.Tensor | None]] | None = None
    # Level 2 freed the weights' values: the checkpoint keys (`expected_keys`) weight updates
    # must fill again before the weights serve (None: nothing to fill).
    _weights_to_refill: frozenset[str] | None = None
    # The decode graphs' sizes, dropped while asleep (they hold the old device addresses).
    _graph_sizes: tuple[int, ...] | None = None

    @property
    def asleep(self) -> tuple[str, ...]:
        """The parts asleep now ("weights", "kv_cache")."""
        return tuple(tag for tag, part in zip(SLEEP_TAGS, (self._sleeping_weights,
                                                            self._sleeping_kv))
                     if part is not None)

    @property
    def weights_discarded(self) -> bool:
        """A level-2 sleep dropped weights that no update has loaded again yet."""
        return self._weights_to_refill is not None

    def weights_loaded(self, keys: Iterable[str]) -> None:
        """A weight update filled these checkpoint keys."""
        if self._weights_to_refill is None:
            return
        left = self._weights_to_refill.difference(keys)
        self._weights_to_refill = frozenset(left) or None
        if left:
            logger.info("%d weights dropped by the level-2 sleep are still to be loaded, e.g. "
                        "%s", len(left), sorted(left)[:3])

    def sleep(self, level: int) -> None:
        """Put the KV cache and weights to sleep; a no-op while any part sleeps (vLLM's rule):
        a retried call must not turn a level-1 sleep into a level-2 one, which would drop
        weights on a CPU device (whose level 1 leaves them in place) and not on CUDA."""
        level = check_sleep_level(level)
        if self.asleep:
            logger.warning("sleep(level=%d): already asleep (%s); wake up first to sleep "
                           "again", level, ", ".join(self.asleep))
            return
        if self.decode_graphs is not None and self.device.type == "cuda":
            self._graph_sizes = tuple(self.decode_graphs.sizes)
            self.decode_graphs = None  # their pool and buffers go with them
            self.cuda_graph_status = "off while asleep: captured again on waking"
        if self._sleeping_kv is None:
            caches = [t for pair in self.kv_caches + self.draft_kv_caches for t in pair]
            self._sleeping_kv = _unique_storages(caches)
            for tensor, _ in self._sleeping_kv:
                tensor.untyped_storage().resize_(0)
        if self._sleeping_weights is None and (level == 2 or self.device.type != "cpu"):
            weights = _unique_storages(self.model.parameters())
            # Level 1 keeps the values on the host (pinned memory: a fast copy back). Every
            # copy is made before any weight is freed: a copy that fails loses nothing.
            pin = self.device.type == "cuda" and torch.cuda.is_available()
            copies = [None] * len(weights) if level == 2 else _host_copies(weights, pin)
            for tensor, _ in weights:
                tensor.untyped_storage().resize_(0)
            self._sleeping_weights = [(tensor, nbytes, copy)
                                      for (tensor, nbytes), copy in zip(weights, copies)]
            if self.lora is not None:
                stacks = [t for w in self.lora.weights.values() for t in (w.a, w.b_t)]
                self._sleeping_lora = _unique_storages(stacks)
                for tensor, _ in self._sleeping_lora:
                    tensor.untyped_storage().resize_(0)
            if level == 2:
                self._weights_to_refill = frozenset(expected_keys(self.model))
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # back to the driver: another process may take it

    def release_kv_memory(self) -> None:
        """Free the KV caches' memory (device and host swap space) for good: the engine has
        stopped, and a stopped engine still referenced (a `with` block's name) must not hold
        a whole pool that the next engine sizes its own from. The weights stay: they are the
        Model's, which other engines may serve; weights a level-1 sleep moved to the host come
        back first (a level-2 sleep dropped them: the Model needs new ones either way)."""
        self._graph_sizes = None  # nothing to capture again
        if self._sleeping_weights is not None \
                and all(copy is not None for _, _, copy in self._sleeping_weights):
            self.wake_up(["weights"])
        self.decode_graphs = None  # their buffers point into the pool
        caches = [t for pair in self.kv_caches + self.draft_kv_caches + self.host_caches
                  for t in pair]
        for tensor, _ in _unique_storages(caches):
            tensor.untyped_storage().resize_(0)
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        chosen = check_wake_tags(tags)
        if "weights" in chosen and self._sleeping_weights is not None:
            for tensor, nbytes, copy in self._sleeping_weights:
                tensor.untyped_storage().resize_(nbytes)
                if copy is not None:
                    _storage_bytes(tensor).copy_(copy)
            pinned = any(copy is not None and copy.is_pinned()
                         for _, _, copy in self._sleeping_weights)
            self._sleeping_weights = None
            if pinned:
                # torch keeps freed pinned blocks cached for reuse: hand the host copies'
                # back to the OS (a trainer sharing the machine wants that memory).
                _release_cached_host_memory()
            if self._sleeping_lora is not None:
                for tensor, nbytes in self._sleeping_lora:
                    tensor.untyped_storage().resize_(nbytes)
                    _storage_bytes(tensor).zero_()  # an empty slot is all zeros
                self._sleeping_lora = None
                for slot, lora_id in list(self.lora.resident.items()):
                    self.lora.activate(slot, lora_id)
        if "kv_cache" in chosen and self._sleeping_kv is not None:
            for tensor, nbytes in self._sleeping_kv:
                tensor.untyped_storage().resize_(nbytes)
                _storage_bytes(tensor).zero_()  # as allocated: padding reads must see zeros
            self._sleeping_kv = None
        if self._graph_sizes is not None and not self.asleep:
            # Only with every part awake: a capture runs the model on the weights and cache.
            sizes, self._graph_sizes = self._graph_sizes, None
            logger.info("capturing the CUDA graphs again after waking")
            self.setup_cuda_graphs(sizes)


def _host_copies(weights: list[tuple[torch.Tensor, int]], pin: bool) -> list[torch.Tensor]:
    """Host copies of the storages, as views of one (pinned when `pin`) buffer: one allocation
    instead of one per weight, each of which the pinned allocator would round up to a power
    of two. Offsets keep 64-byte alignment."""
    offsets, total = [], 0
    for _, nbytes in weights:
        offsets.append(total)
        total += -(-nbytes // 64) * 64
    slab = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    return [slab[off:off + nbytes].copy_(_storage_bytes(tensor))
            for (tensor, nbytes), off in zip(weights, offsets)]


def _release_cached_host_memory() -> None:
    """Free torch's cached, unused pinned host blocks (an internal call: skipped where this
    torch lacks it)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under `tensor`, as a flat uint8 tensor."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
