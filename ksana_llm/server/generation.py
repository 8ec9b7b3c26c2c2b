"""Running the choices of one HTTP request on the engine: submit them all (or none), merge their
outputs into one event stream, wait for them while watching the client, and abort whatever is
left when the client goes away; and running forward-only requests as the queue allows.

A choice is one sequence of one engine request. An engine request returns one sequence, or
several (`num_return_sequences`: beam search, best_of, parallel sampling), listed in
`RequestOutput.sequences`; the choices are all sequences of all requests, in submission order.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HTTPRequest

from ksana_llm.api.engine import Engine, EngineDeadError
from ksana_llm.api.forward_outputs import ForwardHandle, ForwardOutput
from ksana_llm.api.outputs import Request, RequestError, RequestOutput
from ksana_llm.api.request_handle import RequestHandle
from ksana_llm.engine.scheduler_records import QueueFullError, QueueTimeoutError
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.logits_processor import LogitsProcessorError
from ksana_llm.server.errors import (APIError, engine_unavailable, internal_error, queue_full,
                                     waiting_timeout)
from ksana_llm.server.middleware import client_gone
from ksana_llm.server.params import engine_value_error
from ksana_llm.server.request_log import RequestLog

# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25
# How often a forward-only request waiting for room in the queue tries again when none of its
# own requests is left to wait for.
ROOM_POLL_S = 0.02


async def finished_before_client_left(http_request: HTTPRequest, work: asyncio.Future) -> bool:
    """Wait for `work`; False as soon as the HTTP client has gone away instead (checked every
    DISCONNECT_POLL_S). `work` is left as it is: the caller cancels or aborts what it started."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
        if done:
            return True
        if client_gone(http_request.scope) or await http_request.is_disconnected():
            return False


async def run_forward(engine: Engine, submit: Callable[[int], ForwardHandle], count: int,
                      http_request: HTTPRequest) -> list[ForwardOutput] | None:
    """The outputs of `count` forward-only requests (`/forward`, `/v1/embeddings`; `submit(i)`
    queues the i-th), in order, or None when the client went away first; whatever has not
    finished is aborted however this ends.

    They are queued as the queue allows, as `Engine.embed` does: when it is full, wait for the
    oldest of ours to finish. So a request with more inputs than the queue holds still runs
    on an idle server, where refusing it would be a 429 that no retry could ever clear. Only
    when none of ours holds a place (the queue is full of other clients' work) is it a 429.
    """
    handles: list[ForwardHandle] = []
    try:
        for i in range(count):
            handle = await _queue_when_room(submit, i, handles, http_request)
            if handle is None:
                return None
            handles.append(handle)
        results = asyncio.gather(*(h.aresult() for h in handles))
        try:
            if not await finished_before_client_left(http_request, results):
                return None
            return results.result()
        finally:
            _cancel(results)
    except (RequestError, QueueFullError, EngineDeadError) as exc:
        raise map_engine_error(exc) from exc
    finally:
        for handle in handles:
            if not handle.finished:
                engine.abort(handle.id)


async def _queue_when_room(submit: Callable[[int], ForwardHandle], i: int,
                           queued: list[ForwardHandle],
                           http_request: HTTPRequest) -> ForwardHandle | None:
    """`submit(i)`, retried each time one of `queued` may have made room; None if the client
    left meanwhile. QueueFullError when nothing of ours is queued to wait for."""
    while True:
        try:
            return submit(i)
        except QueueFullError:
            if not queued:
                raise
        room = _room(queued)
        try:
            if not await finished_before_client_left(http_request, room):
                return None
        finally:
            _cancel(room)


def _room(queued: list[ForwardHandle]) -> asyncio.Future[Any]:
    """Done when the oldest unfinished request of `queued` ends (its error, if any, is read
    later with the others'); when all ended, after ROOM_POLL_S, since the engine counts its
    queue again only after the step that ended them."""
    pending = next((h for h in queued if not h.finished), None)
    if pending is None:
        return asyncio.ensure_future(asyncio.sleep(ROOM_POLL_S))
    return asyncio.ensure_future(pending.handle.aresult())  # the rows are built later, once


def _cancel(results: asyncio.Future[Any]) -> None:
    """Cancel a gather and consume its outcome: a cancelled gather ends holding a
    CancelledError as its exception, which asyncio logs as never retrieved unless read."""
    results.cancel()
    results.add_done_callback(lambda f: f.cancelled() or f.exception())


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready; its requests were aborted."""


@dataclass
class ChoiceResult:
    """The final output of one choice."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    request: int = 0  # which engine request it came from (its prompt, for completions)


def _sequences(handle: RequestHandle) -> list[ChoiceResult]:
    return [ChoiceResult(seq.text, list(seq.token_ids),
                         list(seq.logprobs) if seq.logprobs is not None else None,
                         seq.finish_reason, seq.stop_reason)
            for seq in handle.output.sequences]


@dataclass
class ChoiceEvent:
    """New output of one choice. `finish_reason` is set on the choice's last event only."""

    index: int
    text: str
    logprobs: list[dict[str, Any]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] = field(default_factory=list)  # tokens this event adds to the choice

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def map_engine_error(exc: BaseException) -> APIError:
    """An engine failure (at submit, or delivered through a handle) as the client's error."""
    cause = exc.__cause__ if isinstance(exc, RequestError) and exc.__cause__ else exc
    if isinstance(cause, QueueFullError):
        return queue_full(str(cause))
    if isinstance(cause, QueueTimeoutError):
        return waiting_timeout(str(cause))
    if isinstance(cause, EngineDeadError):
        return engine_unavailable(str(cause) or "the engine is not running")
    if isinstance(cause, ValueError):
        return engine_value_error(cause)
    if isinstance(cause, LogitsProcessorError):
        return internal_error(str(cause), "logits_processor_error")
    return engine_unavailable("the engine failed while serving this request")


@dataclass
class ChoiceSet:
    """The engine requests behind one HTTP request, in choice order."""

    engine: Engine
    handles: list[RequestHandle] = field(default_factory=list)
    # Set when the request was refused part-way (429, 400): the requests already queued are
    # aborted, and their outputs must not reach the metrics, where the refusal counts once.
    refused: bool = False
    # What an engine failure became once the response had started (a stream): the error event
    # the client got, which the metrics count when the response ends.
    failure: APIError | None = None

    @classmethod
    def submit(cls, engine: Engine, base_id: str,
               jobs: list[tuple[list[int] | dict[str, Any], GenerationConfig]],
               observer: Callable[[GenerationConfig], Callable[[RequestOutput], None]]
               | None = None,
               request_fields: dict[str, Any] | None = None,
               request_log: RequestLog | None = None,
               job_fields: Sequence[dict[str, Any]] | None = None) -> ChoiceSet:
        """Submit every job or none: on the first refusal, abort those already queued.

        `observer(config)` makes one callback per engine request (given its generation config);
        it sees every output of that request on the engine thread (per-token metrics, and the
        finished request). `request_fields`:
        more `Request` fields for every job (KV transfer); `job_fields`: for each job its own
        (its prompt's text, for a plugin). `request_log`: --enable-log-requests.
        """
        loop = asyncio.get_running_loop()
        choices = cls(engine)
        try:
            for i, (prompt, config) in enumerate(jobs):
                if request_log is not None:
                    request_log.submitted(f"{base_id}-{i}", prompt, config, engine.tokenizer,
                                          (request_fields or {}).get("lora"))
                choices.handles.append(engine.submit(
                    Request.of(prompt, config, request_id=f"{base_id}-{i}",
                               callback=choices._observed(observer, config, request_log),
                               **(request_fields or {}),
                               **(job_fields[i] if job_fields is not None else {})),
                    loop=loop))
        except (QueueFullError, EngineDeadError, ValueError) as exc:
            choices.refused = True  # before the aborts: their outputs come after it
            choices.abort_unfinished()
            raise map_engine_error(exc) from exc
        except BaseException:  # a bug's 500: what was queued must not run on unseen
            choices.refused = True
            choices.abort_unfinished()
            raise
        return choices

    def _observed(self, observer: Callable[[GenerationConfig], Callable[[RequestOutput], None]]
                  | None, config: GenerationConfig,
                  request_log: RequestLog | None = None
                  ) -> Callable[[RequestOutput], None] | None:
        """The engine request's callback: `observer(config)`'s, and the finished output's log line
        (--enable-log-outputs); silenced once the set is refused."""
        inner = observer(config) if observer is not None else None
        log = request_log if request_log is not None and request_log.outputs else None
        if inner is None and log is None:
            return None

        def callback(output: RequestOutput) -> None:
            if self.refused:
                return
            if inner is not None:
                inner(output)
            if log is not None and output.finished:
                log.finished(output)

        return callback

    @property
    def num_choices(self) -> int:
        return sum(h.config.num_return_sequences for h in self.handles)

    def results(self) -> list[ChoiceResult]:
        """Every choice's output (final once all requests finished), in choice order."""
        out = []
        for r, handle in enumerate(self.handles):
            for result in _sequences(handle):
                result.request = r
                out.append(result)
        return out

    def abort_unfinished(self) -> None:
        for handle in self.handles:
            if not handle.finished:
                self.engine.abort(handle.id)

    async def wait(self, http_request: HTTPRequest) -> None:
        """Wait for every choice; abort them all if the client disconnects meanwhile."""
        results = asyncio.gather(*(h.aresult() for h in self.handles))
        try:
            if not await finished_before_client_left(http_request, results):
                raise ClientDisconnected()
            results.result()
        except RequestError as exc:
            raise map_engine_error(exc) from exc
        finally:
            _cancel(results)
            self.abort_unfinished()

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Outputs of all choices as they come; the last event of each carries its finish_reason.

        Logprob entries ride along with the text: each event carries the entries produced since the
        previous one (text held back by the detokenizer may arrive an event later than its logprob).
        Parallel samples stream token by token; beams and best_of > n arrive whole at the end
        (they are ranked only then).
        """
        queue: asyncio.Queue[ChoiceEvent | BaseException] = asyncio.Queue()
        # Choice index of each request's first sequence.
        first_index = [0, *itertools.accumulate(h.config.num_return_sequences for h in self.handles)]

        async def pump(first: int, handle: RequestHandle) -> None:
            open_choices = set(range(handle.config.num_return_sequences))
            try:
                async for delta in handle.adeltas():
                    if delta.finish_reason is not None:
                        open_choices.discard(delta.index)
                    queue.put_nowait(ChoiceEvent(first + delta.index, delta.text, delta.logprobs,
                                                 delta.finish_reason, delta.stop_reason,
                                                 list(delta.token_ids)))
                # The request ended: a sequence that never said so (an abort) ends with it.
                reason = handle.output.finish_reason or "abort"
                for index in sorted(open_choices):
                    queue.put_nowait(ChoiceEvent(first + index, "", None, reason))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which maps it
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(first_index[r], h)) for r, h in enumerate(self.handles)]
        remaining = self.num_choices
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    self.failure = map_engine_error(item)
                    raise self.failure from item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            for task in tasks:
                task.cancel()
            self.abort_unfinished()
