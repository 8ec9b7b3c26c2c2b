"""Public request and result records, and the handle that delivers a request's outputs.

A handle is written by the engine thread and read by the caller: blocking (`result`, iteration)
or from asyncio (`aresult`, `astream`) when it was created with an event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ksana_llm.engine.core import StepOutput
from ksana_llm.generation_config import GenerationConfig

logger = logging.getLogger("ksana_llm.api")

Prompt = str | list[int]


@dataclass
class Request:
    """A prompt (text or token ids) with its own settings, priority and optional callback.

    `callback(output: RequestOutput)` runs on the engine thread after every step that changed the
    request; keep it short. Lower `priority` values run first under the "priority" policy.
    """

    prompt: Prompt
    generation_config: GenerationConfig | dict[str, Any] | None = None
    priority: int = 0
    callback: Callable[[RequestOutput], None] | None = None
    request_id: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class SequenceOutput:
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[dict[str, Any]] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    @property
    def sequences(self) -> list[SequenceOutput]:
        cumulative = None
        if self.logprobs is not None:
            cumulative = sum(entry["logprob"] for entry in self.logprobs)
        return [SequenceOutput(self.text, list(self.token_ids), cumulative, self.finish_reason)]


class RequestError(RuntimeError):
    """The engine could not finish this request (it died or shut down)."""


_END = object()


class RequestHandle:
    """Live view of one submitted request."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], config: GenerationConfig,
                 callback: Callable[[RequestOutput], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.id = request_id
        self.config = config
        self.output = RequestOutput(request_id, prompt_token_ids,
                                    logprobs=[] if config.logprobs is not None else None)
        self._callback = callback
        self._loop = loop
        self._sync: queue.Queue[Any] = queue.Queue()
        self._async: asyncio.Queue[Any] | None = asyncio.Queue() if loop is not None else None
        self.error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.output.finished or self.error is not None

    # ---- engine side ----------------------------------------------------------------------------
    def _push(self, item: Any) -> None:
        if self._async is not None:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                pass
        else:
            self._sync.put(item)

    def deliver(self, step: StepOutput, now: float) -> None:
        out = self.output
        out.token_ids.extend(step.new_token_ids)
        out.text += step.text_delta
        if out.logprobs is not None:
            out.logprobs.extend(step.new_logprobs)
        if step.new_token_ids and out.metrics.first_token_time is None:
            out.metrics.first_token_time = now
        if step.finished:
            out.finished = True
            out.finish_reason = step.finish_reason.value if step.finish_reason else None
            out.stop_reason = step.stop_reason
            out.metrics.finished_time = now
        if self._callback is not None:
            try:
                self._callback(out)
            except Exception:  # a user callback must not take the engine down
                logger.exception("callback of request %s raised", self.id)
        if step.text_delta:
            self._push(step.text_delta)
        if step.finished:
            self._push(_END)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._push(error)

    # ---- caller side ----------------------------------------------------------------------------
    def _check(self, item: Any) -> bool:
        """True at the end of the stream; raises the engine's error if there was one."""
        if isinstance(item, BaseException):
            raise RequestError(f"request {self.id} failed: {item}") from item
        return item is _END

    def __iter__(self) -> Iterator[str]:
        """Text deltas as they are produced (blocking)."""
        if self._async is not None:
            raise RuntimeError("this handle was created for asyncio; use astream()")
        while True:
            item = self._sync.get()
            if self._check(item):
                return
            yield item

    def result(self, timeout: float | None = None) -> RequestOutput:
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in self._iter_until(deadline):
            pass
        return self.output

    def _iter_until(self, deadline: float | None) -> Iterator[str]:
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._sync.get(timeout=remaining)
            except queue.Empty:
                raise TimeoutError(f"request {self.id} did not finish in time") from None
            if self._check(item):
                return
            yield item

    async def astream(self) -> AsyncIterator[str]:
        if self._async is None:
            raise RuntimeError("this handle was created without an event loop; iterate it instead")
        while True:
            item = await self._async.get()
            if self._check(item):
                return
            yield item

    async def aresult(self) -> RequestOutput:
        async for _ in self.astream():
            pass
        return self.output
