"""What `Engine` gives the mixins that control it between two steps (LoRA adapters, weight
updates, sleep mode): its core, and a way to run work on the engine thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class EngineThreadWork:
    """Declared here, provided by `Engine`."""

    _core: Any

    def _on_engine_thread(self, work: Callable[[], Any]) -> Any:  # pragma: no cover - Engine's
        raise NotImplementedError

    def _dispatch_step(self, outputs: list) -> None:  # pragma: no cover - Engine's
        raise NotImplementedError
