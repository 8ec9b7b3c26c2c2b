"""How `Engine` hands the core's step outputs to the waiting request handles (on the engine
thread): stats first, then each handle gets its output, finished ones their plugin's postprocess;
asyncio callers' deliveries are batched into one wake-up per event loop."""

from __future__ import annotations

import threading
import time
from typing import Any

from ksana_llm.api.request_handle import AsyncDeliveries, RequestHandle
from ksana_llm.api.stats import StatsTracker
from ksana_llm.engine.outputs import StepOutput

__all__ = ["OutputDelivery"]


class OutputDelivery:
    """Mixed into `Engine`, which provides the attributes declared here."""

    model: Any
    _handles: dict[str, RequestHandle]
    _stats: StatsTracker
    _wake: threading.Condition  # guards _handles against the callers' threads

    def abort(self, request_id: str) -> None:  # pragma: no cover - Engine's
        raise NotImplementedError

    def _abort_unreadable(self) -> None:
        """Abort the requests nobody can read any more (made for an asyncio loop that has
        closed, with no callback): running on to their token limits would spend steps and hold
        blocks for nobody. Looked for now and then rather than per output: a waiting request,
        or a best_of / beam request (whose outputs come at the end), delivers nothing before."""
        with self._wake:
            handles = list(self._handles.values())
        for handle in handles:
            if handle.unreadable and not handle.abort_sent:
                handle.abort_sent = True
                self.abort(handle.id)

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

    def _postprocess(self, handle: RequestHandle) -> Any:
        """The model plugin's postprocess for a finishing request, or None (no plugin, or a
        forward-only request)."""
        plugin = getattr(self.model, "plugin", None)
        if plugin is None or handle.forward_result is not None or handle.plugin_info is None:
            return None  # (None: its preprocess never ran, as for prompt_embeds)
        return lambda output: plugin.run_postprocess(handle.plugin_info, output)
