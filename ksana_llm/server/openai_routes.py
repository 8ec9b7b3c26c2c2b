"""`POST /v1/completions` and `POST /v1/chat/completions`.

Each request is parsed and fully validated (400s, including compiling any output constraint),
then all its choices are submitted (429/503), and only then does the response start, so a
streamed answer never begins with an error that could have been a status code.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.server import kv_transfer
from ksana_llm.server.chat import check_template_kwargs, render_chat
from ksana_llm.server.chat_output import ChatDelta, ChoiceOutputParser
from ksana_llm.server.errors import APIError, bad_request, from_validation_error
from ksana_llm.server.generation import ChoiceSet, ClientDisconnected
from ksana_llm.server.logprobs import (
    chat_logprobs,
    completion_logprobs,
    completion_prompt_logprobs,
    prompt_logprobs_entries,
    vllm_prompt_logprobs,
)
from ksana_llm.server.openai_protocol import (
    MAX_CHOICES,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    Usage,
    _SamplingRequest,
)
from ksana_llm.server.params import (
    beam_search_fields,
    check_logprobs_cap,
    check_token_ids,
    choice_seeds,
    engine_samples_n,
    generation_config,
    prompt_token_lists,
    resolve_max_tokens,
)
from ksana_llm.server.state import ServerState, server_state
from ksana_llm.server.structured_params import (
    StructuredRequest,
    compile_spec,
    from_response_format,
    from_vllm_extras,
    single,
)
from ksana_llm.server.tools import plan_tools

router = APIRouter()

RequestModel = TypeVar("RequestModel", bound=BaseModel)

# Status for a client that left before its answer (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499

# Constraints that make the whole output JSON: such an output has no thinking block.
_JSON_KINDS = ("json_object", "json_schema")


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
    check_logprobs_cap(req.prompt_logprobs, state.max_logprobs, "prompt_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available when streaming.", param="prompt_logprobs")
    if req.best_of is not None:
        if req.best_of < req.n:
            raise bad_request(f"`best_of` ({req.best_of}) must be at least `n` ({req.n}).",
                              param="best_of")
        if req.stream and req.best_of > req.n:
            raise bad_request("`best_of` cannot be used with streaming.", param="best_of")
    state.check_alive()


async def _constraint(state: ServerState, found: list[StructuredRequest | None]) -> tuple[Any, str | None]:
    """The compiled spec of the request's one output constraint (None, None without one)."""
    request = single(found)
    if request is None:
        return None, None
    return await compile_spec(state, request), request.kind


@dataclass
class Jobs:
    """Engine requests for a list of prompts, and which prompt each request answers."""

    items: list[tuple[list[int], GenerationConfig]]
    prompt_of: list[int]  # request index -> prompt index


def _plan_jobs(req: _SamplingRequest, prompts: list[list[int]], state: ServerState, *,
               max_tokens: Callable[[list[int]], int], logprobs: int | None,
               extra: dict[str, Any]) -> Jobs:
    """The engine requests behind `n` choices per prompt.

    Beam search, best_of and plain `n > 1` run as one engine request returning `n` sequences,
    which share the prompt's KV blocks (sequence i of a seeded request samples with seed + i).
    An engine without parallel sampling gets `n` requests with seeds seed + i instead.
    """
    beam = beam_search_fields(req)
    fields = dict(extra)
    per_request = 1
    if beam is not None:
        fields.update(beam)
        per_request = req.n
    elif req.best_of is not None and req.best_of > 1:
        if req.temperature == 0:
            raise bad_request("`best_of` > 1 needs sampling (temperature > 0): greedy choices "
                              "are all the same.", param="best_of")
        fields["best_of"] = req.best_of
        per_request = req.n
    elif req.n > 1 and engine_samples_n():
        per_request = req.n
    if per_request > 1:
        seeds: list[int | None] = [req.seed]
    else:
        seeds = choice_seeds(req.seed, req.n)
    items, prompt_of = [], []
    for p, ids in enumerate(prompts):
        budget = max_tokens(ids)
        for seed in seeds:
            items.append((ids, generation_config(req, max_tokens=budget, logprobs=logprobs,
                                                 seed=seed, limits=state.limits,
                                                 num_return_sequences=per_request, extra=fields)))
            prompt_of.append(p)
    return Jobs(items, prompt_of)


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
    completion = sum(len(r.token_ids) for r in choices.results())
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                 total_tokens=prompt_tokens + completion)


# The refusal's code, which tells a router to send the request to a decode server whole.
LORA_NOT_TRANSFERABLE = "lora_kv_not_transferable"


async def _request_fields(req: _SamplingRequest, state: ServerState, jobs: Jobs
                          ) -> dict[str, Any]:
    """Engine `Request` fields for the request's LoRA adapter (its `model`) and its
    `kv_transfer_params` (see server.kv_transfer)."""
    lora = state.check_model(req.model)
    fields: dict[str, Any] = {} if lora is None else {"lora": lora}
    if req.kv_transfer_params is None:
        return fields
    if lora is not None:
        # The transferred KV does not say which adapter computed it; a router that sees this
        # refusal sends the request to a decode server whole.
        raise bad_request("kv_transfer_params cannot be used with a LoRA adapter.",
                          param="kv_transfer_params", code=LORA_NOT_TRANSFERABLE)
    return await kv_transfer.request_fields(req.kv_transfer_params, state.kv_transfer,
                                            num_sequences=sum(config.num_sequences
                                                            for _, config in jobs.items),
                                            stream=req.stream)


def _kv_response(state: ServerState, choices: ChoiceSet) -> dict[str, Any] | None:
    if len(choices.handles) != 1:
        return None
    return kv_transfer.response_params(state.kv_transfer, choices.handles[0].output)


async def _wait(choices: ChoiceSet, request: Request, state: ServerState) -> bool:
    """Wait for every choice; False (and counted) if the client left first."""
    try:
        await choices.wait(request)
    except ClientDisconnected:
        state.count_failure("aborted")
        return False
    return True


# ---- completions ---------------------------------------------------------------------------------

@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, CompletionRequest)
    _check_common(req, state)
    check_logprobs_cap(req.logprobs, state.max_logprobs, "logprobs")
    prompts = prompt_token_lists(req.prompt, state.tokenizer, state.limits)
    if len(prompts) * req.n > MAX_CHOICES:
        raise bad_request(f"prompts x n must be at most {MAX_CHOICES}.", param="n")
    spec, _ = await _constraint(state, [from_response_format(req.response_format),
                                        *from_vllm_extras(req)])
    extra: dict[str, Any] = {}
    if spec is not None:
        extra["structured_output"] = spec
    # echo with logprobs: the prompt's tokens get logprobs too (the first one null).
    echo_logprobs = req.echo and req.logprobs is not None
    prompt_lp = req.logprobs if echo_logprobs else req.prompt_logprobs
    if prompt_lp is not None:
        extra["prompt_logprobs"] = prompt_lp
    jobs = _plan_jobs(req, prompts, state, logprobs=req.logprobs, extra=extra,
                      max_tokens=lambda ids: resolve_max_tokens(req.max_tokens, len(ids),
                                                                state.limits, "prompt"))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    choices = ChoiceSet.submit(state.engine, request_id, jobs.items,
                               state.request_observer if state.metrics is not None else None,
                               await _request_fields(req, state, jobs))
    prompt_tokens = sum(len(p) for p in prompts)
    echo_texts = ([state.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
                  if req.echo else None)
    created = int(time.time())
    model = state.response_model(req.model)

    def prompt_entries(request_index: int) -> list[dict[str, Any] | None] | None:
        if prompt_lp is None:
            return None
        return prompt_logprobs_entries(choices.handles[request_index].output)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        request_of = [r for r, h in enumerate(choices.handles)
                      for _ in range(h.config.num_return_sequences)]

        async def chunks() -> AsyncIterator[BaseModel]:
            offsets = [0] * choices.num_choices  # characters sent per choice, for text_offset
            echoed = [echo_texts is None] * choices.num_choices
            async for ev in choices.events():
                r = request_of[ev.index]
                if not echoed[ev.index]:
                    # The prompt goes first, once its logprobs (computed at prefill) are known.
                    echoed[ev.index] = True
                    text = echo_texts[jobs.prompt_of[r]]
                    lp = None
                    if echo_logprobs:
                        lp = completion_prompt_logprobs(prompt_entries(r), prompts[jobs.prompt_of[r]],
                                                        state.token_texts)
                        offsets[ev.index] = sum(len(t) for t in lp.tokens)
                    else:
                        offsets[ev.index] = len(text)
                    yield CompletionResponse(id=request_id, created=created, model=model, choices=[
                        CompletionChoice(index=ev.index, text=text, logprobs=lp)])
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

    if not await _wait(choices, request, state):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    result = []
    for i, out in enumerate(choices.results()):
        p = jobs.prompt_of[out.request]
        prefix = echo_texts[p] if echo_texts is not None else ""
        entries = prompt_entries(out.request)
        logprobs = None
        if out.logprobs is not None:
            if echo_logprobs:
                logprobs = completion_prompt_logprobs(entries, prompts[p], state.token_texts)
                offset = sum(len(t) for t in logprobs.tokens)
                generated = completion_logprobs(out.logprobs, state.token_texts, offset)
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(logprobs, name).extend(getattr(generated, name))
            else:
                logprobs = completion_logprobs(out.logprobs, state.token_texts, len(prefix))
        result.append(CompletionChoice(
            index=i, text=prefix + out.text, logprobs=logprobs, finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            prompt_logprobs=(vllm_prompt_logprobs(entries, prompts[p], state.token_texts)
                             if req.prompt_logprobs is not None else None)))
    response = CompletionResponse(id=request_id, created=created, model=model, choices=result,
                                  usage=_usage(prompt_tokens, choices),
                                  kv_transfer_params=_kv_response(state, choices))
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
    check_logprobs_cap(req.top_logprobs, state.max_logprobs, "top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("Give max_completion_tokens or max_tokens, not both with different values.",
                          param="max_completion_tokens")
    tools = plan_tools(req.tools, req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
                       auto_enabled=state.enable_auto_tool_choice, parser=state.tool_parser)
    template_kwargs = check_template_kwargs(req.chat_template_kwargs)
    prompt = render_chat(state.tokenizer, req.messages, state.chat_template,
                         add_generation_prompt=req.add_generation_prompt,
                         continue_final_message=req.continue_final_message,
                         tools=tools.tools, template_kwargs=template_kwargs)
    # The template already holds the special tokens (BOS etc.): do not add them twice.
    ids = list(state.tokenizer.encode(prompt, add_special_tokens=False))
    check_token_ids(ids, state.limits.vocab_size, "messages")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, len(ids), state.limits, "messages")
    spec, kind = await _constraint(state, [from_response_format(req.response_format),
                                           *from_vllm_extras(req), tools.constraint])
    extra: dict[str, Any] = {}
    if spec is not None:
        extra["structured_output"] = spec
    if req.prompt_logprobs is not None:
        extra["prompt_logprobs"] = req.prompt_logprobs
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    jobs = _plan_jobs(req, [ids], state, logprobs=logprobs, extra=extra,
                      max_tokens=lambda _: max_tokens)
    # Reasoning is parsed unless the request turned thinking off, or constrained the whole
    # output to JSON (which leaves no room for a thinking block).
    reasoning = state.reasoning_parser
    if template_kwargs.get("enable_thinking") is False or kind in _JSON_KINDS:
        reasoning = None

    def output_parser() -> ChoiceOutputParser:
        return ChoiceOutputParser(reasoning.stream() if reasoning is not None else None,
                                  tools.stream())

    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = ChoiceSet.submit(state.engine, request_id, jobs.items,
                               state.request_observer if state.metrics is not None else None,
                               await _request_fields(req, state, jobs))
    created = int(time.time())
    model = state.response_model(req.model)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])

        async def chunks() -> AsyncIterator[BaseModel]:
            parsers = [output_parser() for _ in range(choices.num_choices)]
            for i in range(choices.num_choices):
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            async for ev in choices.events():
                parser = parsers[ev.index]
                delta = parser.feed(ev.text) if ev.text else ChatDelta()
                finish_reason = None
                if ev.finish_reason is not None:
                    tail = parser.finish()
                    delta = ChatDelta(delta.reasoning + tail.reasoning, delta.content + tail.content,
                                      delta.tool_calls + tail.tool_calls)
                    finish_reason = parser.finish_reason(ev.finish_reason)
                logprobs = chat_logprobs(ev.logprobs, state.token_texts) if ev.logprobs else None
                if not delta and finish_reason is None and logprobs is None:
                    continue
                message = parser.delta_message(delta) if delta else DeltaMessage()
                yield chunk(ChatStreamChoice(index=ev.index, delta=message, logprobs=logprobs,
                                             finish_reason=finish_reason))
            if include_usage:
                yield ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                          usage=_usage(len(ids), choices))

        return _AbortOnCloseStreamingResponse(_sse_stream(choices, chunks), choices)

    if not await _wait(choices, request, state):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    result = []
    for i, out in enumerate(choices.results()):
        parser = output_parser()
        message = parser.message([parser.feed(out.text), parser.finish()])
        logprobs = chat_logprobs(out.logprobs, state.token_texts) if out.logprobs is not None else None
        result.append(ChatChoice(index=i, message=message, logprobs=logprobs,
                                 finish_reason=parser.finish_reason(out.finish_reason),
                                 stop_reason=out.stop_reason))
    prompt_lps = None
    if req.prompt_logprobs is not None:
        prompt_lps = vllm_prompt_logprobs(prompt_logprobs_entries(choices.handles[0].output), ids,
                                          state.token_texts)
    response = ChatCompletionResponse(id=request_id, created=created, model=model, choices=result,
                                      usage=_usage(len(ids), choices), prompt_logprobs=prompt_lps,
                                      kv_transfer_params=_kv_response(state, choices))
    return JSONResponse(response.model_dump())

