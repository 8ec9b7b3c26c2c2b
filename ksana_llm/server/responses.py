"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A response runs through the chat route's preparation (`chat_run.start_chat`: template, tools,
output constraints, LoRA adapter by `model`), with the Responses request translated by
`responses_protocol`. Output is one choice, read into items: `reasoning` (with a
`--reasoning-parser`), `message` (text, with logprobs when `include` asks), `function_call`s
(tools). Streaming sends OpenAI's typed events (`event: <type>` + `data:`, numbered by
`sequence_number`, no `[DONE]`), ending with `response.completed` or `response.incomplete`.

`store: true` (the default) keeps the response and its conversation in a bounded in-memory store
(`--max-stored-responses`): `GET /v1/responses/{id}` returns it and `previous_response_id`
continues it (the earlier input and output items go first; earlier `instructions` do not carry
over, as in OpenAI's API).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ksana_llm.server.chat_output import ChatDelta, ChoiceOutputParser
from ksana_llm.server.chat_run import ChatRun, start_chat
from ksana_llm.server.errors import APIError, bad_request
from ksana_llm.server.logprobs import chat_logprobs
from ksana_llm.server.openai_protocol import ChatCompletionRequest, ChatMessage
from ksana_llm.server.responses_protocol import (
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    function_call_item,
    input_messages,
    item_id,
    message_item,
    output_items,
    reasoning_item,
    response_logprobs,
    responses_error,
    text_part,
)
from ksana_llm.server.responses_store import StoredResponse
from ksana_llm.server.state import ServerState, server_state
from ksana_llm.server.submission import (
    CLIENT_CLOSED_REQUEST,
    AbortOnCloseStreamingResponse,
    parse_body,
    wait_for_choices,
)

router = APIRouter()


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", type="not_found_error",
                    param=param, code="response_not_found")


@dataclass
class _Plan:
    """A validated request: its conversation items (for the store) and its chat form."""

    req: ResponsesRequest
    items: list[dict[str, Any]]
    chat: ChatCompletionRequest


def _plan(req: ResponsesRequest, state: ServerState) -> _Plan:
    unsupported = req.unsupported_params()
    if unsupported:
        raise bad_request(f"Unsupported parameter(s): {', '.join(unsupported)}.",
                          param=unsupported[0], code="unsupported_parameter")
    input_messages(req.input)  # the new items alone: errors name their own index
    new_items = ([{"type": "message", "role": "user", "content": req.input}]
                 if isinstance(req.input, str) else list(req.input))
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = state.responses.get(req.previous_response_id)
        if stored is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = stored.items
    messages = input_messages(history + new_items)
    if req.instructions:
        messages.insert(0, ChatMessage(role="system", content=req.instructions))
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, stream=req.stream,
        tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=chat_response_format(req.text),
        logprobs=req.wants_logprobs, top_logprobs=req.top_logprobs if req.wants_logprobs else None,
        seed=req.seed, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, stop=req.stop)
    return _Plan(req, history + new_items, chat)


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _response(plan: _Plan, run: ChatRun, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None) -> dict[str, Any]:
    req = plan.req
    return {
        "id": run.request_id, "object": "response", "created_at": run.created, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": run.model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": req.reasoning,
        "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_logprobs": req.top_logprobs, "truncation": req.truncation or "disabled",
        "usage": usage, "user": req.user, "metadata": req.metadata or {}, "background": False,
    }


def _usage(state: ServerState, run: ChatRun, output_tokens: int, reasoning: str) -> dict[str, Any]:
    # Reasoning tokens: the reasoning text's tokens (the parser splits text, not tokens).
    reasoning_tokens = (len(state.tokenizer.encode(reasoning, add_special_tokens=False))
                        if reasoning else 0)
    cached = run.choices.handles[0].output.num_cached_tokens
    return {"input_tokens": len(run.ids),
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
            "total_tokens": len(run.ids) + output_tokens}


def _store(state: ServerState, plan: _Plan, body: dict[str, Any]) -> None:
    if plan.req.store:
        state.responses.put(body["id"], StoredResponse(body, plan.items + body["output"]))


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, ResponsesRequest)
    plan = _plan(req, state)
    try:
        run = await start_chat(plan.chat, state, item_id("resp"))
    except APIError as exc:
        raise responses_error(exc) from exc
    if req.stream:
        return AbortOnCloseStreamingResponse(_stream(state, plan, run), run.choices)
    if not await wait_for_choices(run.choices, request, state):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    out = run.choices.results()[0]
    parser = run.output_parser()
    message = parser.message([parser.feed(out.text), parser.finish()])
    status = _status(out.finish_reason)
    logprobs = (response_logprobs(chat_logprobs(out.logprobs, state.token_texts))
                if out.logprobs is not None else None)
    body = _response(plan, run, status, output_items(message, status, logprobs),
                     _usage(state, run, len(out.token_ids), message.reasoning_content or ""))
    _store(state, plan, body)
    return JSONResponse(body)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> Response:
    stored = server_state(request).responses.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return JSONResponse(stored.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    if not server_state(request).responses.delete(response_id):
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


# ---- streaming -------------------------------------------------------------------------------------

class _Events:
    """SSE framing with OpenAI's event names and a running `sequence_number`."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


@dataclass
class _OpenItem:
    kind: str  # "reasoning" | "message" | "function_call"
    index: int  # its output_index
    id: str
    text: str = ""  # reasoning or message text, or a call's arguments
    call_id: str = ""
    name: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class _OutputEvents:
    """Parsed deltas of the one choice -> output items and their events, opened as their first
    text arrives and closed when another kind starts (or the response ends). Every token's
    logprobs go with the message text (as in the non-streamed answer): those that come before
    any text wait for the next text delta."""

    def __init__(self, events: _Events, parser: ChoiceOutputParser) -> None:
        self.ev = events
        self.parser = parser
        self.output: list[dict[str, Any]] = []
        self.open: _OpenItem | None = None
        self.pending_logprobs: list[dict[str, Any]] = []
        self.message: _OpenItem | None = None

    def add(self, delta: ChatDelta, logprobs: list[dict[str, Any]]) -> Iterator[str]:
        self.pending_logprobs.extend(logprobs)
        if delta.reasoning:
            if self.open is None or self.open.kind != "reasoning":
                yield from self._start(_OpenItem("reasoning", len(self.output), item_id("rs")))
            self.open.text += delta.reasoning
            yield self.ev("response.reasoning_text.delta", item_id=self.open.id,
                          output_index=self.open.index, content_index=0, delta=delta.reasoning)
        if delta.content:
            if self.open is None or self.open.kind != "message":
                yield from self.start_message()
            lp, self.pending_logprobs = self.pending_logprobs, []
            self.open.text += delta.content
            self.open.logprobs.extend(lp)
            yield self.ev("response.output_text.delta", item_id=self.open.id,
                          output_index=self.open.index, content_index=0, delta=delta.content,
                          logprobs=lp)
        for call in delta.tool_calls:
            if call.name is not None:
                yield from self._start(_OpenItem("function_call", len(self.output),
                                                 item_id("fc"), call_id=self.parser.call_id(
                                                     call.index), name=call.name))
            if call.arguments and self.open is not None and self.open.kind == "function_call":
                self.open.text += call.arguments
                yield self.ev("response.function_call_arguments.delta", item_id=self.open.id,
                              output_index=self.open.index, delta=call.arguments)

    def start_message(self) -> Iterator[str]:
        yield from self._start(_OpenItem("message", len(self.output), item_id("msg")))
        self.message = self.open

    def _start(self, item: _OpenItem) -> Iterator[str]:
        yield from self.close("completed")
        self.open = item
        self.output.append({})  # its slot; filled when it closes
        yield self.ev("response.output_item.added", output_index=item.index,
                      item=self._item(item, "in_progress", whole=False))
        if item.kind == "reasoning":
            yield self.ev("response.content_part.added", item_id=item.id,
                          output_index=item.index, content_index=0,
                          part={"type": "reasoning_text", "text": ""})
        elif item.kind == "message":
            yield self.ev("response.content_part.added", item_id=item.id,
                          output_index=item.index, content_index=0, part=text_part(""))

    @staticmethod
    def _item(item: _OpenItem, status: str, whole: bool = True) -> dict[str, Any]:
        if item.kind == "reasoning":
            return reasoning_item(item.text if whole else "", status, item.id)
        if item.kind == "message":
            if not whole:
                return message_item(None, status, item.id)
            return message_item(item.text, status, item.id, logprobs=item.logprobs)
        return function_call_item(item.call_id, item.name, item.text if whole else "", status,
                                  item.id)

    def close(self, status: str) -> Iterator[str]:
        """Close the open item (the response's status for its last one)."""
        item, self.open = self.open, None
        if item is None:
            return
        if item is self.message and self.pending_logprobs:
            item.logprobs.extend(self.pending_logprobs)
            self.pending_logprobs = []
        done = self._item(item, status)
        if item.kind == "reasoning":
            part = {"type": "reasoning_text", "text": item.text}
            yield self.ev("response.reasoning_text.done", item_id=item.id,
                          output_index=item.index, content_index=0, text=item.text)
            yield self.ev("response.content_part.done", item_id=item.id,
                          output_index=item.index, content_index=0, part=part)
        elif item.kind == "message":
            yield self.ev("response.output_text.done", item_id=item.id, output_index=item.index,
                          content_index=0, text=item.text, logprobs=item.logprobs)
            yield self.ev("response.content_part.done", item_id=item.id,
                          output_index=item.index, content_index=0,
                          part=done["content"][0])
        else:
            yield self.ev("response.function_call_arguments.done", item_id=item.id,
                          output_index=item.index, name=item.name, arguments=item.text)
        self.output[item.index] = done
        yield self.ev("response.output_item.done", output_index=item.index, item=done)

    @property
    def reasoning(self) -> str:
        return "".join("".join(p["text"] for p in item.get("content", []))
                       for item in self.output if item.get("type") == "reasoning")


async def _stream(state: ServerState, plan: _Plan, run: ChatRun) -> AsyncIterator[str]:
    ev = _Events()
    snapshot = _response(plan, run, "in_progress", [], None)
    yield ev("response.created", response=snapshot)
    yield ev("response.in_progress", response=snapshot)
    parser = run.output_parser()
    items = _OutputEvents(ev, parser)
    finish_reason = None
    try:
        async for event in run.choices.events():
            delta = parser.feed(event.text) if event.text else ChatDelta()
            if event.finish_reason is not None:
                tail = parser.finish()
                delta = ChatDelta(delta.reasoning + tail.reasoning, delta.content + tail.content,
                                  delta.tool_calls + tail.tool_calls)
                finish_reason = event.finish_reason
            entries = event.logprobs or []
            logprobs = (response_logprobs(chat_logprobs(entries, state.token_texts))
                        if entries and plan.req.wants_logprobs else [])
            for chunk in items.add(delta, logprobs):
                yield chunk
    except APIError as exc:
        yield ev("error", code=exc.code, message=exc.message, param=exc.param)
        failed = _response(plan, run, "failed", items.output, None)
        failed["error"] = {"code": exc.code or "server_error", "message": exc.message}
        yield ev("response.failed", response=failed)
        return
    status = _status(finish_reason)
    if not items.output:  # nothing was said: an empty message, as the non-streamed answer
        for chunk in items.start_message():
            yield chunk
    for chunk in items.close(status):
        yield chunk
    output_tokens = len(run.choices.results()[0].token_ids)
    body = _response(plan, run, status, items.output,
                     _usage(state, run, output_tokens, items.reasoning))
    _store(state, plan, body)
    yield ev("response.completed" if status == "completed" else "response.incomplete",
             response=body)
