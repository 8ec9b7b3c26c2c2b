"""How requests get into `Engine`: validated and tokenized on the caller's thread, then handed
to the engine thread through a small locked inbox, within the waiting queue's bound; aborts go
the same way."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ksana_llm.api.outputs import Prompt, Request
from ksana_llm.api.request_handle import RequestHandle
from ksana_llm.config import EngineConfig
from ksana_llm.engine.request import Sequence
from ksana_llm.engine.scheduler_records import QueueFullError
from ksana_llm.generation_config import GenerationConfig

# How often an asyncio caller waiting for room in a full queue looks again (the engine thread
# signals room to threading waiters only).
ROOM_POLL_S = 0.05

__all__ = ["EngineDeadError", "RequestIntake"]


class EngineDeadError(RuntimeError):
    """The engine stopped (shutdown, or an internal error); it accepts no more requests."""


class RequestIntake:
    """Mixed into `Engine`, which sets the attributes declared here in `_start` (all but the
    handles and the inbox guarded by `_wake`, which the engine thread also takes)."""

    config: EngineConfig
    generation_config: GenerationConfig
    _requests: Any  # a RequestBuilder
    _thread: threading.Thread
    _release_openmp_pool: Callable[[], None]
    _wake: threading.Condition
    _queue_space: threading.Condition
    _inbox: list[tuple[Sequence, RequestHandle]]
    _aborts: list[str]
    _handles: dict[str, RequestHandle]
    _num_waiting: int
    _num_running: int
    _waiting_blocked: bool
    _stopping: bool
    _dead: BaseException | None

    def submit(self, request: Request | Prompt, *,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue a request; returns its handle at once. Raises ValueError for bad input,
        QueueFullError when `max_queue_size` requests are already waiting."""
        if not isinstance(request, Request):
            request = Request.of(request)
        seq, plugin_info = self._requests.sequence(request, self.generation_config)
        return self._enqueue(seq, request.callback, loop, plugin_info)

    def _enqueue(self, seq: Sequence, callback: Any, loop: asyncio.AbstractEventLoop | None,
                 plugin_info: Any) -> RequestHandle:
        # Both are used on the engine thread, where a wrong type would fail the step loop.
        if loop is not None and not isinstance(loop, asyncio.AbstractEventLoop):
            raise ValueError(f"loop must be an asyncio event loop, got {type(loop).__name__}")
        if callback is not None and not callable(callback):
            raise ValueError(f"callback must be callable, got {type(callback).__name__}")
        if threading.current_thread() is not self._thread:
            self._release_openmp_pool()
        handle = RequestHandle(seq.request_id, seq.prompt_token_ids, seq.config,
                               callback=callback, loop=loop)
        handle.plugin_info = plugin_info
        handle.engine_thread = self._thread
        handle.output.metrics.arrival_time = seq.arrival_time
        with self._wake:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(f"the engine is not running: {self._dead or 'shut down'}")
            if seq.request_id in self._handles:
                raise ValueError(f"request_id {seq.request_id!r} is already in use")
            if self._num_queued() >= self.config.max_queue_size:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_queue_size} "
                                     "requests); retry later")
            if seq.request_id in self._aborts:
                # Aimed at an earlier request of this id (none is live, or the id would be in
                # use): the loop reads its inbox before its aborts, so it would stop this one.
                self._aborts = [a for a in self._aborts if a != seq.request_id]
            self._inbox.append((seq, handle))
            self._handles[seq.request_id] = handle
            self._wake.notify()
        return handle

    def _enqueue_many(self, pending: deque[tuple[Sequence, Any, Any]]) -> list[RequestHandle]:
        """Enqueue (sequence, plugin info, callback) triples from the front of `pending`, popping
        each, until the queue is full; the handles, which queue no per-step deltas (the caller
        reads their results alone, in turn: `RequestHandle.results_only`). All under one hold
        of the lock, so the engine thread sees them together: which requests share the first
        steps does not depend on how the two threads interleave."""
        handles: list[RequestHandle] = []
        with self._wake:
            while pending:
                seq, plugin_info, callback = pending[0]
                try:
                    handle = self._enqueue(seq, callback, None, plugin_info)
                except QueueFullError:
                    break
                handle.results_only()  # before the engine thread can see the request
                handles.append(handle)
                pending.popleft()
        return handles

    def _wait_for_queue_space(self) -> None:
        """Block until one more request would not be refused (or the engine stopped)."""
        if threading.current_thread() is self._thread:  # (a callback's batch call)
            raise RuntimeError("the queue is full, and waiting for room on the engine thread "
                               "(in a callback) would wait forever for that thread")
        with self._wake:
            while (self._num_queued() >= self.config.max_queue_size and self._dead is None
                   and not self._stopping):
                self._queue_space.wait()

    def _num_queued(self) -> int:
        """Requests that would wait if one more came now: those not yet running, less the free
        sequence slots they are about to take (so a request that starts at once never counts
        as queued, however quickly the next one arrives). Call with _wake held."""
        free_slots = max(0, self.config.max_num_seqs - self._num_running)
        if self._waiting_blocked:
            # The last step left requests waiting for KV memory, or the engine sleeps: a free
            # slot takes none of them.
            return self._num_waiting + len(self._inbox)
        return max(0, self._num_waiting + len(self._inbox) - free_slots)

    def abort(self, request_id: str) -> None:
        """Stop a request; its handle finishes with finish_reason "abort" and its blocks are freed."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()
