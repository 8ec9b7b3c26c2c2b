"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel` (background responses);
the response objects and events themselves are made in `responses_answers`.

A response runs through the chat route's preparation (`chat_run.start_chat`: template, tools,
output constraints, LoRA adapter by `model`), with the Responses request translated by
`responses_protocol`. Output is one choice, read into items (`responses_events`): `reasoning`
(with a `--reasoning-parser`), `message` (text, with logprobs when `include` asks),
`function_call`s (tools). Streaming sends OpenAI's typed events (`event: <type>` + `data:`, numbered by
`sequence_number`, no `[DONE]`), ending with `response.completed` or `response.incomplete`.

`store: true` (the default) keeps the response and its conversation in a bounded in-memory store
(`--max-stored-responses`): `GET /v1/responses/{id}` returns it and `previous_response_id`
continues it (the earlier input and output items go first; earlier `instructions` do not carry
over, as in OpenAI's API).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ksana_llm.api.outputs import RequestError
from ksana_llm.server.chat_run import ChatRun, start_chat
from ksana_llm.server.errors import APIError, bad_request
from ksana_llm.server.event_log import EventLog
from ksana_llm.server.openai_protocol import ChatCompletionRequest, ChatMessage
from ksana_llm.server.responses_answers import (ResponsePlan, answer, failed_body,
                                                finished_body, output_items, response_body,
                                                stream_events)
from ksana_llm.server.responses_events import SseEvents
from ksana_llm.server.responses_protocol import (
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    check_call_outputs,
    check_unique_item_ids,
    input_item_resources,
    input_messages,
    item_id,
    responses_error,
)
from ksana_llm.server.responses_store import StoredResponse, item_page
from ksana_llm.server.state import BackgroundResponse, ServerState, server_state
from ksana_llm.server.submission import (
    CLIENT_CLOSED_REQUEST,
    AbortOnCloseStreamingResponse,
    parse_body,
    wait_for_choices,
)

router = APIRouter()
logger = logging.getLogger("ksana_llm.server")


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", type="not_found_error",
                    param=param, code="response_not_found")


def _plan(req: ResponsesRequest, state: ServerState) -> ResponsePlan:
    unsupported = req.unsupported_params()
    if unsupported:
        raise bad_request(f"Unsupported parameter(s): {', '.join(unsupported)}.",
                          param=unsupported[0], code="unsupported_parameter")
    req.check_include()
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true.",
                          param="stream_options")
    new_items: list[dict[str, Any]] = []
    if req.input is not None or req.previous_response_id is None:
        input_messages(req.input)  # the new items alone: errors name their own index
        new_items = input_item_resources(req.input)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = state.responses.get(req.previous_response_id)
        if stored is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        if req.previous_response_id in state.background_responses:
            raise bad_request("The previous response is still in progress.",
                              param="previous_response_id")
        history = stored.items
    if req.input is not None:
        check_unique_item_ids(req.input, history)
        check_call_outputs(req.input, history)
    # The model's sampling defaults for what the request left out, here rather than at
    # submission only: the response reports the temperature and top_p it ran with.
    defaults = {name: getattr(state.sampling_defaults, name) for name in ("temperature", "top_p")
                if getattr(req, name) is None and getattr(state.sampling_defaults, name) is not None}
    if defaults:
        req = req.model_copy(update=defaults)
    return ResponsePlan(req, history + new_items, _chat_request(req, history + new_items))


def _chat_request(req: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat form of a Responses request over the conversation `items`."""
    messages = input_messages(items)
    if req.instructions:
        messages.insert(0, ChatMessage(role="system", content=req.instructions))
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, stream=bool(req.stream),
        tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=chat_response_format(req.text),
        logprobs=req.wants_logprobs, top_logprobs=req.top_logprobs if req.wants_logprobs else None,
        seed=req.seed, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, stop=req.stop, priority=req.priority,
        cache_salt=req.cache_salt, reasoning_effort=req.reasoning_effort)


def _without_oldest_turn(items: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`truncation: "auto"`: the conversation without its oldest turn (None when it has only
    one). OpenAI drops items "in the middle of the conversation": the leading system and
    developer messages stay, and a turn goes whole, from one user message to the next, so no
    tool output loses its call."""
    head = 0
    while head < len(items) and items[head].get("type", "message") == "message" \
            and items[head].get("role") in ("system", "developer"):
        head += 1
    for i in range(head + 1, len(items)):
        item = items[i]
        if item.get("type", "message") == "message" and item.get("role") == "user":
            return items[:head] + items[i:]
    return None


async def _start(plan: ResponsePlan, state: ServerState) -> ChatRun:
    """Submit the plan's chat request; with `truncation: "auto"`, a conversation longer than
    the context loses its oldest turns until it fits (OpenAI's rule: items go from the
    beginning; `instructions` stay). The stored conversation keeps every item."""
    chat, items = plan.chat, plan.items
    while True:
        try:
            return await start_chat(chat, state, item_id("resp"))
        except APIError as exc:
            shorter = _without_oldest_turn(items) if plan.req.truncation == "auto" \
                and exc.code == "context_length_exceeded" else None
            if shorter is None:
                raise responses_error(exc) from exc
            items = shorter
            chat = _chat_request(plan.req, items)


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, ResponsesRequest)
    plan = _plan(req, state)
    if req.background and req.store is False:
        raise bad_request("A background response must be stored (store: true).",
                          param="background")
    if req.background and not state.responses.max_entries:
        # Its answer could never be polled (vLLM refuses it too when it stores nothing).
        raise bad_request("This server stores no responses (--max-stored-responses 0), so it "
                          "runs none in the background.", param="background")
    run = await _start(plan, state)
    if req.background and req.stream:
        return StreamingResponse(_start_background_stream(state, plan, run).follow(),
                                 media_type="text/event-stream")
    if req.background:
        return JSONResponse(_start_background(state, plan, run))
    if req.stream:
        return AbortOnCloseStreamingResponse(stream_events(state, plan, run), run.choices)
    if not await wait_for_choices(run.choices, request, state):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(_complete(state, plan, run))


def _complete(state: ServerState, plan: ResponsePlan, run: ChatRun) -> dict[str, Any]:
    items, status = output_items(state, plan, run)
    return answer(state, plan, run, status, items)


# ---- background responses (`background: true`) ----------------------------------------------------

def _start_background(state: ServerState, plan: ResponsePlan, run: ChatRun) -> dict[str, Any]:
    """Store the response as in progress and answer at once; a task waits for the choice and
    stores the finished response (`GET /v1/responses/{id}` polls it)."""
    body = response_body(plan, run, "in_progress", [], None)
    state.responses.put(body["id"], StoredResponse(body, plan.items))
    task = asyncio.create_task(_finish_background(state, plan, run))
    state.background_responses[run.request_id] = BackgroundResponse(run, task, body)
    return body


async def _finish_background(state: ServerState, plan: ResponsePlan, run: ChatRun) -> None:
    entry_id = run.request_id
    try:
        failure = None
        try:
            await asyncio.gather(*(h.aresult() for h in run.choices.handles))
        except RequestError as exc:
            failure = str(exc)
        entry = state.background_responses.get(entry_id)
        cancelled = entry is not None and entry.cancelled
        if failure is not None and not cancelled:
            body = failed_body(plan, run, [], "server_error", failure)
        else:
            items, status = output_items(state, plan, run, "cancelled" if cancelled else None)
            body = finished_body(state, plan, run, status, items)  # stored even if failed
        if entry is None or not entry.deleted:
            state.responses.put(entry_id, StoredResponse(body, plan.items))
    except Exception:  # noqa: BLE001 - a background task has no caller to raise to
        logger.exception("background response %s failed", entry_id)
    finally:
        state.background_responses.pop(entry_id, None)


def _start_background_stream(state: ServerState, plan: ResponsePlan, run: ChatRun) -> EventLog:
    """Store the response as in progress and stream it into an event log that outlives any
    reader: the POST that asked follows it, and `GET ...?stream=true&starting_after=N` may
    resume it; a reader going away does not stop the run (POST /cancel does). When it ends, the
    finished response is stored with its events."""
    body = response_body(plan, run, "in_progress", [], None)
    state.responses.put(body["id"], StoredResponse(body, plan.items))
    log = EventLog()

    async def produce() -> None:
        final: dict[str, Any] = {}
        try:
            events = stream_events(state, plan, run, cancelled=lambda: entry.cancelled,
                                   finished=final.update)
            async with contextlib.aclosing(events):
                async for event in events:
                    log.append(event)
        except Exception:  # noqa: BLE001 - a background task has no caller to raise to
            logger.exception("background response %s failed", run.request_id)
            final = failed_body(plan, run, [], "server_error",
                                "The server failed while answering.")
            ev = SseEvents()
            ev.sequence_number = len(log.events)
            log.append(ev("response.failed", response=final))
        finally:
            log.close()
            state.background_responses.pop(run.request_id, None)
        if entry.deleted:  # (`answer` stores a finished response as it ends)
            state.responses.delete(run.request_id)
        elif final:  # stored with its events (a failed one too)
            state.responses.put(run.request_id, StoredResponse(final, plan.items,
                                                               tuple(log.events)))

    # (The task first runs after this returns, so `entry` is there for it.)
    entry = BackgroundResponse(run, asyncio.create_task(produce()), body, events=log)
    state.background_responses[run.request_id] = entry
    return log


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, stream: bool = False,
                            starting_after: int | None = None) -> Response:
    """The stored response; with `stream=true` (a background response created with `stream:
    true`) its events after `starting_after`, live while it runs."""
    state = server_state(request)
    stored = state.responses.get(response_id)
    running = state.background_responses.get(response_id)  # (kept even if the store drops it)
    if stored is None and (running is None or running.deleted):
        raise not_found(response_id)
    if not stream:
        return JSONResponse(stored.body if stored is not None else running.body)
    if starting_after is not None and starting_after < 0:
        raise bad_request("`starting_after` must be a sequence number (>= 0).",
                          param="starting_after")
    log = running.events if running is not None else None
    if log is None:
        if stored is None or not stored.events:  # (stored None: dropped from a full store)
            raise bad_request("Only a background response created with stream: true can be "
                              "streamed; GET it without stream.", param="stream")
        log = EventLog()
        for event in stored.events:
            log.append(event)
        log.close()
    return StreamingResponse(log.follow(starting_after), media_type="text/event-stream")


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, limit: int = 20,
                           order: str = "desc", after: str | None = None,
                           before: str | None = None) -> Response:
    """The items a stored response answered (the whole conversation before it, then its own
    input), paged as OpenAI pages lists."""
    if not 1 <= limit <= 100:
        raise bad_request("`limit` must be between 1 and 100.", param="limit")
    if order not in ("asc", "desc"):
        raise bad_request("`order` must be 'asc' or 'desc'.", param="order")
    stored = server_state(request).responses.get(response_id)
    if stored is None:
        raise not_found(response_id)
    try:
        return JSONResponse(item_page(stored.inputs, limit=limit, order=order, after=after,
                                      before=before))
    except LookupError as exc:
        raise bad_request(f"No input item with id '{after if exc.args[0] == 'after' else before}'"
                          " in this response.", param=exc.args[0]) from None


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    """Stop a background response that is still running; it is stored as "cancelled", with
    what it had written."""
    state = server_state(request)
    stored = state.responses.get(response_id)
    entry = state.background_responses.get(response_id)
    if entry is not None and entry.deleted:  # still stopping; GET and DELETE say 404 already
        raise not_found(response_id)
    if entry is None:
        if stored is None:
            raise not_found(response_id)
        if stored.body.get("background") and stored.body.get("status") != "in_progress":
            # OpenAI: cancelling again (or after it ended) returns the final response.
            return JSONResponse(stored.body)
        raise bad_request("Only a background response can be cancelled.", param=None)
    entry.cancelled = True
    entry.run.choices.abort_unfinished()
    await asyncio.shield(entry.task)
    stored = state.responses.get(response_id)
    # (Dropped from a full store meanwhile: what it was, cancelled.)
    return JSONResponse(stored.body if stored is not None
                        else {**entry.body, "status": "cancelled"})


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    """Forget a stored response; one still running in the background stops, and is not
    stored when it ends."""
    state = server_state(request)
    running = state.background_responses.get(response_id)
    if running is not None and not running.deleted:
        running.deleted = True
        running.run.choices.abort_unfinished()
    elif not state.responses.get(response_id):
        raise not_found(response_id)
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


