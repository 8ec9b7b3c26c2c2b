"""The LoRA adapters an engine serves, by name; thread-safe.

Names resolve on callers' threads (a request naming an unknown adapter is a ValueError before it
reaches the engine); adapters are registered on the engine thread (`Engine.load_lora_adapter`).
Any number may be registered: each is held in host memory, and the scheduler copies it into one
of the `max_loras` device slots when a step needs it (see engine.lora_residency). An unloaded
adapter stops resolving at once but stays registered, unlisted, for the requests that already
hold it until the engine frees it (vLLM unlists an adapter and lets its requests finish). Each
registration gets its own id and prefix-cache salt, so KV computed under an adapter is never
served to a request of another adapter, nor of a later adapter registered under the same name.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraAdapterInfo:
    name: str
    path: str
    lora_id: int  # >= 1, never reused by the engine
    cache_salt: int


class LoraRegistry:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._loaded: dict[str, LoraAdapterInfo] = {}
        self._reserved: set[str] = set()  # names whose registration runs
        self._unlisted: dict[int, LoraAdapterInfo] = {}  # unloaded, still held by requests
        self._ids = itertools.count(1)

    def resolve(self, name: str) -> LoraAdapterInfo:
        with self._lock:
            info = self._loaded.get(name)
        if info is None:
            raise ValueError(f"lora: no LoRA adapter named {name!r} is loaded"
                             + (f" (loaded: {', '.join(sorted(self._loaded))})" if self._loaded
                                else ""))
        return info

    def adapters(self) -> list[LoraAdapterInfo]:
        """The registered adapters, oldest first."""
        with self._lock:
            return sorted(self._loaded.values(), key=lambda info: info.lora_id)

    def names(self) -> dict[int, str]:
        """Adapter id -> name, unlisted adapters included (their requests still report it)."""
        with self._lock:
            return {info.lora_id: info.name
                    for info in (*self._loaded.values(), *self._unlisted.values())}

    def reserve(self, name: str, path: str, load_inplace: bool = False) -> LoraAdapterInfo:
        """Claim `name` for the adapter in `path` (not resolvable until `commit`).
        `load_inplace`: the name may be loaded already (the adapter `commit` replaces)."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"lora_name must be a non-empty name without surrounding spaces, "
                             f"got {name!r}")
        if not self.num_slots:
            raise ValueError("this engine has no LoRA slots: set max_loras (or lora_modules)")
        with self._lock:
            if name in self._reserved or (name in self._loaded and not load_inplace):
                raise ValueError(f"lora_name: an adapter named {name!r} is already loaded "
                                 "(load_inplace replaces it)")
            self._reserved.add(name)
            lora_id = next(self._ids)
            return LoraAdapterInfo(name, str(path), lora_id, hash(("lora", name, str(path),
                                                                   lora_id)))

    def commit(self, info: LoraAdapterInfo) -> None:
        """`info` resolves by its name from now on; an adapter it replaces (`load_inplace`) is
        unlisted, as `remove` does."""
        with self._lock:
            self._reserved.discard(info.name)
            replaced = self._loaded.get(info.name)
            if replaced is not None:
                self._unlisted[replaced.lora_id] = replaced
            self._loaded[info.name] = info

    def cancel(self, info: LoraAdapterInfo) -> None:
        with self._lock:
            self._reserved.discard(info.name)

    def remove(self, name: str) -> LoraAdapterInfo:
        """Unlist `name`: it no longer resolves (the name is free for a new adapter); the
        adapter stays registered, unlisted, until `freed`."""
        with self._lock:
            info = self._loaded.pop(name, None)
            if info is not None:
                self._unlisted[info.lora_id] = info
        if info is None:
            raise ValueError(f"lora: no LoRA adapter named {name!r} is loaded")
        return info

    def unlisted_ids(self) -> list[int]:
        with self._lock:
            return list(self._unlisted)

    def freed(self, lora_id: int) -> None:
        """An unlisted adapter's weights are gone: requests resolved to it can no longer run."""
        with self._lock:
            self._unlisted.pop(lora_id, None)

    def is_registered(self, lora_id: int) -> bool:
        """Whether requests of adapter `lora_id` can run (loaded, or unloaded but not freed)."""
        with self._lock:
            return lora_id in self._unlisted or any(
                info.lora_id == lora_id for info in self._loaded.values())


def startup_adapters(registry: LoraRegistry, modules: Mapping[str, str]
                     ) -> list[LoraAdapterInfo]:
    """Ids for the adapters named in the engine's config, in order (registered by the runner as
    it is built, then committed by the caller)."""
    return [registry.reserve(name, path) for name, path in modules.items()]
