"""Which LoRA adapter lives in which of an engine's slots, by name; thread-safe.

Names resolve on callers' threads (a request naming an unknown adapter is a ValueError before it
reaches the engine); slots are written on the engine thread (`Engine.load_lora_adapter`). Each
load gets its own prefix-cache salt, so KV computed under an adapter is never served to a request
of another adapter, nor of a later adapter loaded under the same name.
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
    slot: int  # 1..max_loras
    cache_salt: int


class LoraRegistry:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._loaded: dict[str, LoraAdapterInfo] = {}
        self._reserved: dict[str, int] = {}  # name -> slot, while its load runs
        self._loads = itertools.count(1)

    def resolve(self, name: str) -> LoraAdapterInfo:
        with self._lock:
            info = self._loaded.get(name)
        if info is None:
            raise ValueError(f"lora: no LoRA adapter named {name!r} is loaded"
                             + (f" (loaded: {', '.join(sorted(self._loaded))})" if self._loaded
                                else ""))
        return info

    def adapters(self) -> list[LoraAdapterInfo]:
        with self._lock:
            return sorted(self._loaded.values(), key=lambda info: info.slot)

    def reserve(self, name: str, path: str) -> LoraAdapterInfo:
        """Claim a free slot for adapter `name` (not resolvable until `commit`)."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"lora_name must be a non-empty name without surrounding spaces, "
                             f"got {name!r}")
        if not self.num_slots:
            raise ValueError("this engine has no LoRA slots: set max_loras (or lora_modules)")
        with self._lock:
            if name in self._loaded or name in self._reserved:
                raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
            used = {info.slot for info in self._loaded.values()} | set(self._reserved.values())
            free = [slot for slot in range(1, self.num_slots + 1) if slot not in used]
            if not free:
                raise ValueError(f"all {self.num_slots} LoRA slots (max_loras) are taken; "
                                 "unload an adapter first")
            self._reserved[name] = free[0]
            return LoraAdapterInfo(name, str(path), free[0],
                                   hash(("lora", name, str(path), next(self._loads))))

    def commit(self, info: LoraAdapterInfo) -> None:
        with self._lock:
            self._reserved.pop(info.name, None)
            self._loaded[info.name] = info

    def cancel(self, info: LoraAdapterInfo) -> None:
        with self._lock:
            self._reserved.pop(info.name, None)

    def remove(self, name: str) -> LoraAdapterInfo:
        with self._lock:
            info = self._loaded.pop(name, None)
        if info is None:
            raise ValueError(f"lora: no LoRA adapter named {name!r} is loaded")
        return info


def startup_adapters(registry: LoraRegistry, modules: Mapping[str, str]
                     ) -> list[LoraAdapterInfo]:
    """Slots for the adapters named in the engine's config, in order (loaded by the runner as
    it is built, then committed by the caller)."""
    return [registry.reserve(name, path) for name, path in modules.items()]
