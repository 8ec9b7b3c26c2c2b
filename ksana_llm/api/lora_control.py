"""`Engine`'s LoRA adapter management: loading and unloading adapters while it serves.

Adapters are registered on the engine thread between steps (`Engine._on_engine_thread`); under
tensor parallelism every rank reads its slices in the same gap. The scheduler moves them into
device slots as steps need them (engine.lora_residency).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ksana_llm.api.engine_thread import EngineThreadWork
from ksana_llm.api.lora_registry import LoraRegistry
from ksana_llm.engine.request import Sequence

logger = logging.getLogger("ksana_llm.engine")


class LoraControl(EngineThreadWork):
    """Mixed into `Engine`, which provides `_lora`, `_core`, `_on_engine_thread` and
    `_schedules_nothing`."""

    _lora: LoraRegistry
    _schedules_nothing: Callable[[], bool]  # SleepControl's: asleep, or woken without weights

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters: name -> folder."""
        return {info.name: info.path for info in self._lora.adapters()}

    def load_lora_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> None:
        """Load the PEFT adapter in folder `path` (into host memory; a device slot when a step
        needs it); requests may then name it (`Request(lora=name)`). `load_inplace` (vLLM's):
        replace the adapter loaded under `name` -- requests submitted from now on get the new
        one, those holding the old one finish with it (as after `unload_lora_adapter`), and a
        load that fails keeps the old one. Raises ValueError for a taken name (without
        `load_inplace`), an engine without slots (max_loras), or an adapter this engine cannot
        apply (rank above max_lora_rank, unsupported modules)."""
        if not isinstance(load_inplace, bool):
            raise ValueError(f"load_inplace must be a bool, got {type(load_inplace).__name__}")
        info = self._lora.reserve(name, path, load_inplace=load_inplace)

        def register() -> None:
            self._core.runner.register_lora(info.lora_id, info.path)
            # On the engine thread: every request submitted before this call has reached the
            # core, holding the adapter it resolved (a replaced one is freed when they end).
            self._lora.commit(info)

        try:
            self._on_engine_thread(register)
        except BaseException:
            self._lora.cancel(info)
            raise

    def unload_lora_adapter(self, name: str) -> None:
        """Unlist adapter `name`: new requests naming it are refused (ValueError) from now on,
        and the name may be loaded again at once. Requests that hold it (submitted before this
        call) finish with it, as vLLM lets them; its weights and slot are freed when the last
        one ends. Raises ValueError when no adapter has that name."""
        self._lora.resolve(name)  # an unknown name fails here, on the caller's thread
        self._on_engine_thread(lambda: self._unload(name))

    def _unload(self, name: str) -> None:
        # On the engine thread, after every request submitted before the call reached the core.
        self._lora.remove(name)
        self._free_unlisted_loras()

    def _free_unlisted_loras(self) -> None:
        """Free the unloaded adapters no queued, running or swapped-out request holds any more
        (on the engine thread, between steps). Not while asleep: the slots' memory is given
        back then (clearing a slot would write into nothing); freed after waking."""
        unlisted = self._lora.unlisted_ids()
        if not unlisted or self._schedules_nothing():
            return
        in_use = self._core.lora_ids_in_use()
        for lora_id in unlisted:
            if lora_id in in_use:
                continue
            try:
                self._core.forget_lora(lora_id)
                self._core.runner.unregister_lora(lora_id)
            except Exception:  # noqa: BLE001 - a leaked host copy must not stop the engine
                logger.warning("freeing unloaded LoRA adapter %d failed", lora_id, exc_info=True)
            finally:
                self._lora.freed(lora_id)  # once freed (or failed: not retried every step)

    def _lora_still_loaded(self, seq: Sequence) -> bool:
        """Whether the adapter a new sequence resolved is still registered (it may have been
        unloaded and freed between the caller's lookup and the engine thread's pick-up)."""
        return not seq.lora_id or self._lora.is_registered(seq.lora_id)
