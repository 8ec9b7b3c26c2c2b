"""The handle that delivers a request's outputs (`RequestHandle`).

A handle is written by the engine thread and read by the caller: blocking (`result`, iteration)
or from asyncio (`aresult`, `astream`) when it was created with an event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from ksana_llm.api.outputs import RequestError, RequestOutput, SequenceDelta, SequenceOutput
from ksana_llm.engine.outputs import StepOutput
from ksana_llm.generation_config import GenerationConfig

logger = logging.getLogger("ksana_llm.api")


def _apply_step(target: Any, step: Any, reason: str | None) -> None:
    """Add one engine step to a SequenceOutput or to the RequestOutput (same field names)."""
    target.token_ids.extend(step.new_token_ids)
    target.text += step.text_delta
    if target.logprobs is not None:
        target.logprobs.extend(step.new_logprobs)
    target.cumulative_logprob, target.score = step.cumulative_logprob, step.score
    if step.finish_reason is not None:
        target.finish_reason, target.stop_reason = reason, step.stop_reason


_END = object()


class AsyncDeliveries:
    """Items for handles read from asyncio loops, gathered while the engine thread delivers one
    step and handed to each loop in one `call_soon_threadsafe`: one wake-up of the loop per step
    instead of one per sequence (each wake-up is a syscall, and the loop's thread then competes
    with the engine thread for the GIL)."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, target: asyncio.Queue, item: Any) -> None:
        self._by_loop.setdefault(loop, []).append((target, item))

    def flush(self) -> None:
        by_loop, self._by_loop = self._by_loop, {}
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for target, item in items:
        target.put_nowait(item)


class RequestHandle:
    """Live view of one submitted request.

    Iterating it (or `astream()` for asyncio handles) yields the text deltas of sequence 0;
    `deltas()` / `adeltas()` yield a `SequenceDelta` per step and sequence (use them for
    n > 1: the server streams one choice per sequence index). `result()` / `aresult()` wait for
    the final `RequestOutput`.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], config: GenerationConfig,
                 callback: Callable[[RequestOutput], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.id = request_id
        self.config = config
        self.output = RequestOutput(request_id, prompt_token_ids,
                                    logprobs=[] if config.logprobs is not None else None)
        if config.num_return_sequences > 1:
            self.output.sequence_outputs = [
                SequenceOutput(logprobs=[] if config.logprobs is not None else None)
                for _ in range(config.num_return_sequences)]
        self._callback = callback
        self._loop = loop
        self._sync: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._async: asyncio.Queue[Any] | None = asyncio.Queue() if loop is not None else None
        self.error: BaseException | None = None
        # Cleared once the reader only waits for the end (`result` / `aresult`): the engine then
        # stops queueing per-step deltas nobody reads, and the reader is woken once, not per
        # token (for an asyncio reader every wake-up is a task step that holds the GIL).
        self._deltas_wanted = True
        # What ended the stream, once a reader took it off the queue (True: the end; else the
        # error): a later reader gets the same answer at once instead of waiting forever.
        self._end_seen: bool | BaseException = False
        self.forward_result: Any = None  # a core ForwardResult, for forward-only requests
        self.plugin_info: Any = None  # what the model plugin's preprocess returned, if it ran
        # The thread that produces this handle's outputs: a blocking read there (from a
        # callback or logits processor) would wait for itself forever.
        self.engine_thread: threading.Thread | None = None
        self.abort_sent = False  # the engine aborted it on its own (nobody could read it)
        # Set by the engine thread once the final output is complete (callback run, end queued).
        self._delivered = False

    @property
    def finished(self) -> bool:
        return self.output.finished or self.error is not None

    @property
    def unreadable(self) -> bool:
        """Made for an asyncio loop that has closed, with no callback: nobody can read this
        request's outputs any more (its caller's `asyncio.run` returned without awaiting it)."""
        return self._loop is not None and self._loop.is_closed() and self._callback is None

    # ---- engine side ----------------------------------------------------------------------------
    def _push(self, item: Any, batch: AsyncDeliveries | None = None) -> None:
        if self._async is not None and batch is not None:
            batch.add(self._loop, self._async, item)
        elif self._async is not None:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                pass
        else:
            self._sync.put(item)

    def deliver(self, step: StepOutput, now: float,
                before_final: Callable[[RequestOutput], None] | None = None,
                batch: AsyncDeliveries | None = None) -> None:
        """Apply one core output. `before_final(output)` runs on the request's last output,
        after the output is complete and before anyone (callback, waiters) sees it finished.
        An asyncio reader gets its items through `batch` when one is given (the caller
        flushes it)."""
        out = self.output
        if step.forward is not None:
            self.forward_result = step.forward
        reason = step.finish_reason.value if step.finish_reason else None
        if out.sequence_outputs:
            _apply_step(out.sequence_outputs[step.index], step, reason)
        if step.index == 0:  # the top-level fields mirror sequence 0
            _apply_step(out, step, reason)
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = step.prompt_logprobs
        if step.first_scheduled_time is not None and out.metrics.first_scheduled_time is None:
            out.metrics.first_scheduled_time = step.first_scheduled_time
        if step.num_cached_tokens is not None:
            out.num_cached_tokens = step.num_cached_tokens
        if step.new_token_ids and out.metrics.first_token_time is None:
            out.metrics.first_token_time = now
        if step.finished:
            out.finished = True
            out.exported_kv = step.exported_kv
            if out.finish_reason is None:  # e.g. aborted before sequence 0 produced anything
                out.finish_reason, out.stop_reason = reason, step.stop_reason
            for seq in out.sequence_outputs:
                if seq.finish_reason is None:
                    seq.finish_reason = reason
            out.metrics.finished_time = now
            if before_final is not None:
                before_final(out)
        self._call_back(out)
        if self._deltas_wanted and (step.text_delta or step.new_token_ids
                                    or step.finish_reason is not None):
            self._push(SequenceDelta(step.index, step.text_delta, list(step.new_token_ids),
                                     list(step.new_logprobs) if self.config.logprobs is not None
                                     else None, reason, step.stop_reason), batch)
        if step.finished:
            self._push(_END, batch)
            self._delivered = True

    def _call_back(self, out: RequestOutput) -> None:
        if self._callback is not None:
            try:
                self._callback(out)
            # A user callback must not take the engine down, whatever it raises (sys.exit(), a
            # stray CancelledError or KeyboardInterrupt): on this thread that would end the step
            # loop for every request.
            except BaseException:  # noqa: BLE001
                logger.exception("callback of request %s raised", self.id)

    def fail(self, error: BaseException, batch: AsyncDeliveries | None = None) -> None:
        """The request ended with `error` (a queue timeout, a refusal on the engine thread, the
        engine stopping): readers get it raised, and a callback gets a copy of the output as it
        stood, finished with finish_reason "abort" (`error` says why), so a caller that waits on
        the callback alone is never left waiting. The handle's own output stays unfinished:
        the request did not end well (the server's metrics count it a failure)."""
        self.error = error
        out = self.output
        if self._callback is not None and not out.finished:
            self._call_back(dataclasses.replace(
                out, finished=True, finish_reason=out.finish_reason or "abort", error=str(error),
                sequence_outputs=[dataclasses.replace(s, finish_reason=s.finish_reason or "abort")
                                  for s in out.sequence_outputs]))
        self._push(error, batch)

    # ---- caller side ----------------------------------------------------------------------------
    def _check(self, item: Any) -> bool:
        """True at the end of the stream; raises the engine's error if there was one. The end
        (or error) goes back on the queue, so every other reader waiting on it wakes too."""
        if isinstance(item, BaseException) or item is _END:
            self._end_seen = True if item is _END else item
            if self._async is not None:
                self._async.put_nowait(item)
            else:
                self._sync.put(item)
        if isinstance(item, BaseException):
            raise RequestError(f"request {self.id} failed: {item}") from item
        return item is _END

    @property
    def end_read(self) -> bool:
        """Whether a reader has taken the end of the stream (result / deltas ran to the end)."""
        return self._end_seen is not False

    def _refuse_waiting_on_the_engine_thread(self) -> None:
        if threading.current_thread() is self.engine_thread:
            raise RuntimeError(
                f"request {self.id}: a blocking read on the engine thread (in a callback or "
                "logits processor) would wait forever for that thread; submit the request there "
                "and read it from another thread, or with asyncio")

    def _already_ended(self) -> bool:
        """Whether a reader took the stream's end already (raising again if it was an error)."""
        seen = self._end_seen
        if isinstance(seen, BaseException):
            raise RequestError(f"request {self.id} failed: {seen}") from seen
        return seen

    def deltas(self) -> Iterator[SequenceDelta]:
        """Every sequence's deltas as they are produced (blocking)."""
        if self._async is not None:
            raise RuntimeError("this handle was created for asyncio; use adeltas()")
        if self._already_ended():
            return
        self._refuse_waiting_on_the_engine_thread()
        while True:
            item = self._sync.get()
            if self._check(item):
                return
            yield item

    def __iter__(self) -> Iterator[str]:
        """Sequence 0's text deltas as they are produced (blocking)."""
        for delta in self.deltas():
            if delta.index == 0 and delta.text:
                yield delta.text

    def results_only(self) -> None:
        """Stop queueing per-step deltas: the caller reads the final output alone (`output`
        stays live, the stream does not). `result()` / `aresult()` do this on their first
        call; a caller that will wait on many handles in turn does it for all of them first,
        or each one waited on later piles up a delta (and its token list) per token meanwhile:
        garbage that lengthens the collector's passes on the engine thread."""
        self._deltas_wanted = False

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output (blocking; TimeoutError after `timeout` s). From the first call on,
        the handle stops queueing per-step deltas (`results_only`)."""
        self.results_only()
        if self._already_ended():
            return self.output
        if self._async is not None:  # its items go to the event loop's queue, never here
            if self.error is not None:
                raise RequestError(f"request {self.id} failed: {self.error}") from self.error
            if self._delivered:  # finished: the output is whole, whether awaited or not
                return self.output
            raise RuntimeError("this handle was created for asyncio and its request is still "
                               "running; use `await aresult()`")
        self._refuse_waiting_on_the_engine_thread()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._sync.get(timeout=remaining)
            except queue.Empty:
                raise TimeoutError(f"request {self.id} did not finish in time") from None
            if self._check(item):
                return self.output

    async def adeltas(self) -> AsyncIterator[SequenceDelta]:
        """Every sequence's deltas as they are produced (asyncio)."""
        if self._async is None:
            raise RuntimeError("this handle was submitted without an event loop, so it is read "
                               "blocking (result(), iteration, deltas()); to await it, submit "
                               "with loop=asyncio.get_running_loop()")
        if self._already_ended():
            return
        while True:
            item = await self._async.get()
            if self._check(item):
                return
            yield item

    async def astream(self) -> AsyncIterator[str]:
        """Sequence 0's text deltas as they are produced (asyncio)."""
        async for delta in self.adeltas():
            if delta.index == 0 and delta.text:
                yield delta.text

    async def aresult(self) -> RequestOutput:
        """The final output (asyncio); like `result`, it ends the per-step deltas."""
        self.results_only()
        async for _ in self.adeltas():
            pass
        return self.output
