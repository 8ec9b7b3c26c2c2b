"""`Engine`'s LoRA adapter management: loading and unloading adapters while it serves.

Adapters are registered on the engine thread between steps (`Engine._on_engine_thread`); under
tensor parallelism every rank reads its slices in the same gap. The scheduler moves them into
device slots as steps need them (engine.lora_residency).
"""

from __future__ import annotations

from ksana_llm.api.engine_thread import EngineThreadWork
from ksana_llm.api.lora_registry import LoraRegistry
from ksana_llm.engine.request import Sequence


class LoraControl(EngineThreadWork):
    """Mixed into `Engine`, which provides `_lora`, `_core` and `_on_engine_thread`."""

    _lora: LoraRegistry

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters: name -> folder."""
        return {info.name: info.path for info in self._lora.adapters()}

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in folder `path` (into host memory; a device slot when a step
        needs it); requests may then name it (`Request(lora=name)`). Raises ValueError for a
        taken name, an engine without slots (max_loras), or an adapter this engine cannot
        apply (rank above max_lora_rank, unsupported modules)."""
        info = self._lora.reserve(name, path)
        try:
            self._on_engine_thread(lambda: self._core.runner.register_lora(info.lora_id,
                                                                           info.path))
        except BaseException:
            self._lora.cancel(info)
            raise
        self._lora.commit(info)

    def unload_lora_adapter(self, name: str) -> None:
        """Forget adapter `name` (and free its slot). Raises ValueError when no adapter has that name, or while
        requests using it (submitted before this call) are still queued or running: abort them
        or wait for them first."""
        self._lora.resolve(name)  # an unknown name fails here, on the caller's thread
        self._on_engine_thread(lambda: self._unload(name))

    def _unload(self, name: str) -> None:
        # On the engine thread, after every request submitted before the call reached the core.
        info = self._lora.resolve(name)
        if info.lora_id in self._core.lora_ids_in_use():
            raise ValueError(f"lora_name: adapter {name!r} is used by queued or running "
                             "requests")
        self._lora.remove(name)
        self._core.forget_lora(info.lora_id)
        self._core.runner.unregister_lora(info.lora_id)

    def _lora_still_loaded(self, seq: Sequence) -> bool:
        """Whether the adapter a new sequence resolved is still registered (it may have been
        unloaded between the caller's lookup and the engine thread's pick-up)."""
        return not seq.lora_id or self._lora.is_registered(seq.lora_id)
