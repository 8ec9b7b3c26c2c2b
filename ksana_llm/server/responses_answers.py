"""A Responses API answer from its run: the response object (in progress, finished, failed),
its output items, and its streamed events (`stream_events`). Shared by the routes and by
background responses (`responses`)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ksana_llm.server.chat_output import ChatDelta
from ksana_llm.server.chat_run import ChatRun
from ksana_llm.server.errors import APIError
from ksana_llm.server.logprobs import chat_logprobs
from ksana_llm.server.openai_protocol import ChatCompletionRequest
from ksana_llm.server.responses_events import OutputItems, SseEvents
from ksana_llm.server.responses_protocol import ResponsesRequest, response_logprobs
from ksana_llm.server.responses_store import StoredResponse
from ksana_llm.server.state import ServerState

logger = logging.getLogger("ksana_llm.server")


@dataclass
class ResponsePlan:
    """A validated request: its conversation items (for the store) and its chat form."""

    req: ResponsesRequest
    items: list[dict[str, Any]]
    chat: ChatCompletionRequest


def status_for(finish_reason: str | None) -> str:
    """"length": cut by max_output_tokens; "abort": stopped before its end (the engine shut
    down, or the request was aborted)."""
    return {"length": "incomplete", "abort": "failed"}.get(finish_reason or "", "completed")


def failed_body(plan: ResponsePlan, run: ChatRun, output: list[dict[str, Any]], code: str,
                message: str) -> dict[str, Any]:
    body = response_body(plan, run, "failed", output, None)
    body["error"] = {"code": code, "message": message}
    return body


def answer(state: ServerState, plan: ResponsePlan, run: ChatRun, status: str,
           items: OutputItems) -> dict[str, Any]:
    """The finished response (stored when asked; a failed one never is)."""
    body = finished_body(state, plan, run, status, items)
    if status != "failed" and plan.req.store is not False:
        state.responses.put(body["id"], StoredResponse(body, plan.items))
    return body


def finished_body(state: ServerState, plan: ResponsePlan, run: ChatRun, status: str,
                  items: OutputItems) -> dict[str, Any]:
    if status == "failed":
        return failed_body(plan, run, items.output, "server_error",
                           "The request was aborted before it finished.")
    output_tokens = len(run.choices.results()[0].token_ids)
    return response_body(plan, run, status, items.output,
                         _usage(state, run, output_tokens, items.reasoning))


def response_body(plan: ResponsePlan, run: ChatRun, status: str,
                  output: list[dict[str, Any]], usage: dict[str, Any] | None
                  ) -> dict[str, Any]:
    req = plan.req
    return {
        "id": run.request_id, "object": "response", "created_at": run.created, "status": status,
        # OpenAI's: when it completed, only once it has (this body is built as it finishes).
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": run.model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": req.reasoning,
        "store": req.store is not False, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": {"type": "text"}, **(req.text or {})},  # OpenAI fills in the format
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_logprobs": req.top_logprobs, "truncation": req.truncation or "disabled",
        "usage": usage, "user": req.user, "metadata": req.metadata or {}, "background": bool(req.background),
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


def output_items(state: ServerState, plan: ResponsePlan, run: ChatRun,
                 status: str | None = None) -> tuple[OutputItems, str]:
    """The finished choice read into output items, and the response's status (`status` when
    given, else from how the choice ended)."""
    out = run.choices.results()[0]
    parser = run.output_parser()
    items = OutputItems(SseEvents(), parser)
    for _ in items.add(parser.feed(out.text), _logprobs(state, plan, out.logprobs)):
        pass
    for _ in items.add(parser.finish(), []):
        pass
    status = status or status_for(out.finish_reason)
    # A cancelled response's items are "incomplete" (items have no "cancelled" status).
    for _ in items.finish("incomplete" if status == "cancelled" else status):
        pass
    return items, status


def _logprobs(state: ServerState, plan: ResponsePlan, entries: list[dict[str, Any]] | None
              ) -> list[dict[str, Any]]:
    if not entries or not plan.req.wants_logprobs:
        return []
    return response_logprobs(chat_logprobs(entries, state.token_texts))


def _final_event(status: str) -> str:
    # (OpenAI names no event for a cancelled response: it ends like one cut short.)
    return {"completed": "response.completed", "incomplete": "response.incomplete",
            "cancelled": "response.incomplete"}.get(status, "response.failed")


async def stream_events(state: ServerState, plan: ResponsePlan, run: ChatRun,
                        cancelled: Callable[[], bool] = lambda: False,
                        finished: Callable[[dict[str, Any]], None] | None = None
                        ) -> AsyncIterator[str]:
    """The response's events. `cancelled()` says whether POST /cancel stopped it (a background
    response: it then ends as "cancelled"); `finished` receives the final response object."""
    ev = SseEvents()
    snapshot = response_body(plan, run, "in_progress", [], None)
    yield ev("response.created", response=snapshot)
    yield ev("response.in_progress", response=snapshot)
    parser = run.output_parser()
    items = OutputItems(ev, parser)
    finish_reason = None
    try:
        async for event in run.choices.events():
            delta = parser.feed(event.text) if event.text else ChatDelta()
            for chunk in items.add(delta, _logprobs(state, plan, event.logprobs)):
                yield chunk
            if event.finish_reason is not None:
                finish_reason = event.finish_reason
                for chunk in items.add(parser.finish(), []):
                    yield chunk
    except Exception as exc:  # noqa: BLE001 - the 200 is out: the failure becomes events
        error = exc if isinstance(exc, APIError) else None
        if error is None:
            logger.exception("a streamed response failed")
        code = "rate_limit_exceeded" if error is not None and error.status == 429 \
            else "server_error"
        message = error.message if error is not None else "The server failed while answering."
        yield ev("error", code=code, message=message, param=error.param if error else None)
        for chunk in items.close("incomplete"):
            yield chunk
        failed = failed_body(plan, run, items.output, code, message)
        if finished is not None:
            finished(failed)
        yield ev("response.failed", response=failed)
        return
    status = "cancelled" if cancelled() else status_for(finish_reason)
    # A cancelled response's items are "incomplete" (items have no "cancelled" status).
    for chunk in items.finish("incomplete" if status == "cancelled" else status):
        yield chunk
    body = answer(state, plan, run, status, items)
    if finished is not None:
        finished(body)
    yield ev(_final_event(status), response=body)
