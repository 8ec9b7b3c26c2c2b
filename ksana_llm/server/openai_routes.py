"""`POST /v1/completions` and `POST /v1/chat/completions`.

Each request is parsed and fully validated (400s), then all its choices are submitted (429/503),
and only then does the response start, so a streamed answer never begins with an error that could
have been a status code.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from ksana_llm.server.chat import render_chat
from ksana_llm.server.errors import APIError, bad_request, from_validation_error
from ksana_llm.server.generation import ChoiceSet, ClientDisconnected
from ksana_llm.server.logprobs import chat_logprobs, completion_logprobs
from ksana_llm.server.openai_protocol import (MAX_CHOICES, ChatChoice, ChatCompletionChunk,
                                              ChatCompletionRequest, ChatCompletionResponse,
                                              ChatResponseMessage, ChatStreamChoice,
                                              CompletionChoice, CompletionRequest,
                                              CompletionResponse, DeltaMessage, Usage,
                                              _SamplingRequest)
from ksana_llm.server.params import (check_token_ids, choice_seeds, generation_config,
                                     prompt_token_lists, resolve_max_tokens)
from ksana_llm.server.state import ServerState, server_state

router = APIRouter()

RequestModel = TypeVar("RequestModel", bound=BaseModel)

# Status for a client that left before its answer (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499


async def parse_body(request: Request, model: type[RequestModel]) -> RequestModel:
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _check_common(req: _SamplingRequest, state: ServerState) -> None:
    state.check_model(req.model)
    unsupported = req.unsupported_params()
    if unsupported:
        raise bad_request(f"Unsupported parameter(s): {', '.join(unsupported)}.",
                          param=unsupported[0], code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")
    state.check_alive()


class _AbortOnCloseStreamingResponse(StreamingResponse):
    """Aborts the choices however the response ends: finished, client gone, or never started."""

    def __init__(self, content: AsyncIterator[str], choices: ChoiceSet) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.abort_unfinished()


def _sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json(exclude_none=True) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


async def _sse_stream(choices: ChoiceSet, chunks: Callable[[], AsyncIterator[BaseModel]]) -> AsyncIterator[str]:
    """SSE framing; an engine failure after the 200 went out becomes an error event."""
    try:
        async for chunk in chunks():
            yield _sse(chunk)
    except APIError as exc:
        yield _sse(exc.body())
    yield "data: [DONE]\n\n"


def _usage(prompt_tokens: int, choices: ChoiceSet) -> Usage:
    completion = sum(len(h.output.token_ids) for h in choices.handles)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                 total_tokens=prompt_tokens + completion)


# ---- completions ---------------------------------------------------------------------------------

@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, CompletionRequest)
    _check_common(req, state)
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which are not supported yet.",
                          param="echo", code="unsupported_parameter")
    if req.echo and req.n > 1:
        raise bad_request("echo with n > 1 is not supported.", param="echo", code="unsupported_parameter")
    prompts = prompt_token_lists(req.prompt, state.tokenizer, state.limits)
    if len(prompts) * req.n > MAX_CHOICES:
        raise bad_request(f"prompts x n must be at most {MAX_CHOICES}.", param="n")
    seeds = choice_seeds(req.seed, req.n)
    jobs = []
    for ids in prompts:
        max_tokens = resolve_max_tokens(req.max_tokens, len(ids), state.limits, "prompt")
        for seed in seeds:
            jobs.append((ids, generation_config(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                                seed=seed, limits=state.limits)))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    choices = ChoiceSet.submit(state.engine, request_id, jobs,
                               state.request_observer if state.metrics is not None else None)
    prompt_tokens = sum(len(p) for p in prompts)
    # Choice i answers prompt i // n; echo needs that prompt's text.
    echo_texts = ([state.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
                  if req.echo else None)
    created = int(time.time())
    model = state.served_model_name

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks() -> AsyncIterator[BaseModel]:
            offsets = [0] * len(jobs)  # characters sent per choice, for logprobs.text_offset
            if echo_texts is not None:
                for i, text in enumerate(echo_texts):
                    offsets[i] = len(text)
                    yield CompletionResponse(id=request_id, created=created, model=model,
                                             choices=[CompletionChoice(index=i, text=text)])
            async for ev in choices.events():
                logprobs = None
                if ev.logprobs is not None:
                    logprobs = completion_logprobs(ev.logprobs, state.token_texts, offsets[ev.index])
                    offsets[ev.index] += sum(len(t) for t in logprobs.tokens)
                    logprobs = logprobs if logprobs.tokens else None
                if not ev.text and ev.finish_reason is None and logprobs is None:
                    continue
                yield CompletionResponse(id=request_id, created=created, model=model, choices=[
                    CompletionChoice(index=ev.index, text=ev.text, logprobs=logprobs,
                                     finish_reason=ev.finish_reason, stop_reason=ev.stop_reason)])
            if include_usage:
                yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                         usage=_usage(prompt_tokens, choices))

        return _AbortOnCloseStreamingResponse(_sse_stream(choices, chunks), choices)

    try:
        await choices.wait(request)
    except ClientDisconnected:
        state.count_failure("aborted")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    result = []
    for i, handle in enumerate(choices.handles):
        out = handle.output
        prefix = echo_texts[i // req.n] if echo_texts is not None else ""
        logprobs = (completion_logprobs(out.logprobs, state.token_texts, len(prefix))
                    if out.logprobs is not None else None)
        result.append(CompletionChoice(index=i, text=prefix + out.text, logprobs=logprobs,
                                       finish_reason=out.finish_reason, stop_reason=out.stop_reason))
    response = CompletionResponse(id=request_id, created=created, model=model, choices=result,
                                  usage=_usage(prompt_tokens, choices))
    return JSONResponse(response.model_dump())


# ---- chat ----------------------------------------------------------------------------------------

@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, ChatCompletionRequest)
    if req.chat_template is not None:
        raise bad_request("A chat template cannot be sent with the request; the server uses its own "
                          "(set at start-up with --chat-template).", param="chat_template",
                          code="unsupported_parameter")
    _check_common(req, state)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true.", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("Give max_completion_tokens or max_tokens, not both with different values.",
                          param="max_completion_tokens")
    prompt = render_chat(state.tokenizer, req.messages, state.chat_template,
                         add_generation_prompt=req.add_generation_prompt,
                         continue_final_message=req.continue_final_message)
    # The template already holds the special tokens (BOS etc.): do not add them twice.
    ids = list(state.tokenizer.encode(prompt, add_special_tokens=False))
    check_token_ids(ids, state.limits.vocab_size, "messages")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, len(ids), state.limits, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    jobs = [(ids, generation_config(req, max_tokens=max_tokens, logprobs=logprobs, seed=seed,
                                    limits=state.limits))
            for seed in choice_seeds(req.seed, req.n)]
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = ChoiceSet.submit(state.engine, request_id, jobs,
                               state.request_observer if state.metrics is not None else None)
    created = int(time.time())
    model = state.served_model_name

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])

        async def chunks() -> AsyncIterator[BaseModel]:
            for i in range(len(jobs)):
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            async for ev in choices.events():
                logprobs = (chat_logprobs(ev.logprobs, state.token_texts)
                            if ev.logprobs else None)
                if not ev.text and ev.finish_reason is None and logprobs is None:
                    continue
                delta = DeltaMessage(content=ev.text) if ev.text else DeltaMessage()
                yield chunk(ChatStreamChoice(index=ev.index, delta=delta, logprobs=logprobs,
                                             finish_reason=ev.finish_reason))
            if include_usage:
                yield ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                          usage=_usage(len(ids), choices))

        return _AbortOnCloseStreamingResponse(_sse_stream(choices, chunks), choices)

    try:
        await choices.wait(request)
    except ClientDisconnected:
        state.count_failure("aborted")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    result = []
    for i, handle in enumerate(choices.handles):
        out = handle.output
        logprobs = chat_logprobs(out.logprobs, state.token_texts) if out.logprobs is not None else None
        result.append(ChatChoice(index=i, message=ChatResponseMessage(content=out.text),
                                 logprobs=logprobs, finish_reason=out.finish_reason,
                                 stop_reason=out.stop_reason))
    response = ChatCompletionResponse(id=request_id, created=created, model=model, choices=result,
                                      usage=_usage(len(ids), choices))
    return JSONResponse(response.model_dump())
