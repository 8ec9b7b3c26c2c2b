"""How `Engine` hands the core's step outputs to the waiting request handles (on the engine
thread): stats first, then each handle gets its output, finished ones their plugin's postprocess;
asyncio callers' deliveries are batched into one wake-up per event loop."""

from __future__ import annotations

import time
from typing import Any

from ksana_llm.api.outputs import AsyncDeliveries, RequestHandle
from ksana_llm.api.stats import StatsTracker
from ksana_llm.engine.outputs import StepOutput

__all__ = ["OutputDelivery"]


class OutputDelivery:
    """Mixed into `Engine`, which provides the attributes declared here."""

    model: Any
    _handles: dict[str, RequestHandle]
    _stats: StatsTracker
    _aborts: list[str]  # request ids to abort before the next step

    def abort(self, request_id: str) -> None:  # pragma: no cover - Engine's
        raise NotImplementedError

    def _dispatch_step(self, outputs: list[StepOutput]) -> None:
        self._stats.record_outputs(outputs)
        self._dispatch(outputs)

    def _dispatch(self, outputs: list) -> None:
        now = time.monotonic()
        batch = AsyncDeliveries()
        try:
            for out in outputs:
                self._deliver(out, now, batch)
        finally:
            batch.flush()

    def _deliver(self, out: StepOutput, now: float, batch: AsyncDeliveries) -> None:
        handle = self._handles.get(out.request_id)
        if handle is None:
            return
        if out.finished and out.error is not None:
            del self._handles[out.request_id]
            handle.fail(out.error, batch)
            return
        handle.deliver(out, now, self._postprocess(handle) if out.finished else None, batch)
        if out.finished:
            del self._handles[out.request_id]
            self._stats.record_finished(handle.output)
        elif out.index == 0 and handle.unreadable and out.request_id not in self._aborts:
            # Running on to its token limit would spend steps (and hold blocks) for nobody.
            self.abort(out.request_id)

    def _postprocess(self, handle: RequestHandle) -> Any:
        """The model plugin's postprocess for a finishing request, or None (no plugin, or a
        forward-only request)."""
        plugin = getattr(self.model, "plugin", None)
        if plugin is None or handle.forward_result is not None or handle.plugin_info is None:
            return None  # (None: its preprocess never ran, as for prompt_embeds)
        return lambda output: plugin.run_postprocess(handle.plugin_info, output)
