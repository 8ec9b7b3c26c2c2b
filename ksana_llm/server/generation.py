"""Running the choices of one HTTP request on the engine: submit them all (or none), merge their
outputs into one event stream, wait for them while watching the client, and abort whatever is
left when the client goes away.

The engine serves one sequence per request, so `n` choices are `n` engine requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HTTPRequest

from ksana_llm.api.engine import Engine, EngineDeadError
from ksana_llm.api.outputs import Request, RequestError, RequestHandle, RequestOutput
from ksana_llm.engine.scheduler import QueueFullError, QueueTimeoutError
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.server.errors import APIError, engine_unavailable, queue_full
from ksana_llm.server.params import engine_value_error

# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready; its requests were aborted."""


@dataclass
class ChoiceEvent:
    """New output of one choice. `finish_reason` is set on the choice's last event only."""

    index: int
    text: str
    logprobs: list[dict[str, Any]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


def map_engine_error(exc: BaseException) -> APIError:
    """An engine failure (at submit, or delivered through a handle) as the client's error."""
    cause = exc.__cause__ if isinstance(exc, RequestError) and exc.__cause__ else exc
    if isinstance(cause, QueueFullError):
        return queue_full(str(cause))
    if isinstance(cause, QueueTimeoutError):
        return engine_unavailable(str(cause))
    if isinstance(cause, EngineDeadError):
        return engine_unavailable(str(cause) or "the engine is not running")
    if isinstance(cause, ValueError):
        return engine_value_error(cause)
    return engine_unavailable("the engine failed while serving this request")


@dataclass
class ChoiceSet:
    """The engine requests behind one HTTP request, in choice order."""

    engine: Engine
    handles: list[RequestHandle] = field(default_factory=list)

    @classmethod
    def submit(cls, engine: Engine, base_id: str, jobs: list[tuple[list[int], GenerationConfig]],
               observer: Callable[[], Callable[[RequestOutput], None]] | None = None) -> ChoiceSet:
        """Submit every job or none: on the first refusal, abort those already queued.

        `observer()` makes one callback per choice; it sees every output of that choice on the
        engine thread (per-token metrics, and the finished request).
        """
        loop = asyncio.get_running_loop()
        choices = cls(engine)
        try:
            for i, (prompt_ids, config) in enumerate(jobs):
                choices.handles.append(engine.submit(
                    Request(prompt_ids, generation_config=config, request_id=f"{base_id}-{i}",
                            callback=observer() if observer is not None else None),
                    loop=loop))
        except (QueueFullError, EngineDeadError, ValueError) as exc:
            choices.abort_unfinished()
            raise map_engine_error(exc) from exc
        return choices

    def abort_unfinished(self) -> None:
        for handle in self.handles:
            if not handle.finished:
                self.engine.abort(handle.id)

    async def wait(self, http_request: HTTPRequest) -> None:
        """Wait for every choice; abort them all if the client disconnects meanwhile."""
        results = asyncio.gather(*(h.aresult() for h in self.handles))
        try:
            while True:
                done, _ = await asyncio.wait({results}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await http_request.is_disconnected():
                    raise ClientDisconnected()
            results.result()
        except RequestError as exc:
            raise map_engine_error(exc) from exc
        finally:
            results.cancel()
            self.abort_unfinished()

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Outputs of all choices as they come; the last event of each carries its finish_reason.

        Logprob entries ride along with the text: each event carries the entries produced since the
        previous one (text held back by the detokenizer may arrive an event later than its logprob).
        """
        queue: asyncio.Queue[ChoiceEvent | BaseException] = asyncio.Queue()

        async def pump(index: int, handle: RequestHandle) -> None:
            seen = 0

            def new_logprobs() -> list[dict[str, Any]] | None:
                nonlocal seen
                entries = handle.output.logprobs
                if entries is None:
                    return None
                fresh = entries[seen:]
                seen += len(fresh)
                return fresh

            try:
                async for delta in handle.astream():
                    queue.put_nowait(ChoiceEvent(index, delta, new_logprobs()))
                out = handle.output
                queue.put_nowait(ChoiceEvent(index, "", new_logprobs(), out.finish_reason or "stop",
                                             out.stop_reason))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which maps it
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(self.handles)]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise map_engine_error(item) from item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            for task in tasks:
                task.cancel()
            self.abort_unfinished()
