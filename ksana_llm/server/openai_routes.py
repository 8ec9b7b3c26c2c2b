"""`POST /v1/completions` and `POST /v1/chat/completions`.

Each request is parsed and fully validated (400s, including compiling any output constraint),
then all its choices are submitted (429/503), and only then does the response start, so a
streamed answer never begins with an error that could have been a status code.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from ksana_llm.server.chat_output import ChatDelta
from ksana_llm.server.chat_run import start_chat
from ksana_llm.server.errors import APIError, bad_request
from ksana_llm.server.generation import ChoiceSet
from ksana_llm.server.logprobs import (
    TextOffsets,
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
    CompletionTokensDetails,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
)
from ksana_llm.server.params import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    check_logprobs_cap,
    prediction_usage,
    prompt_token_lists,
    resolve_max_tokens,
    truncated_prompt,
)
from ksana_llm.server.prompt_embeds import decode_prompt_embeds
from ksana_llm.server.state import ServerState, server_state
from ksana_llm.server.structured_params import from_response_format, from_vllm_extras
from ksana_llm.server.submission import (
    CLIENT_CLOSED_REQUEST,
    AbortOnCloseStreamingResponse,
    check_common,
    constraint,
    heavy_logprobs,
    kv_response,
    off_the_loop_if,
    parse_body,
    plan_jobs,
    plugin_sees,
    request_fields,
    wait_for_choices,
)

router = APIRouter()


def _sse(payload: BaseModel | dict, *, null_usage: bool = False) -> str:
    """One SSE event. `null_usage`: a chunk without usage says `"usage": null` (the dump
    leaves None fields out; the key goes last, as one more member of the object)."""
    if not isinstance(payload, BaseModel):
        return f"data: {json.dumps(payload)}\n\n"
    body = payload.model_dump_json(exclude_none=True)
    if null_usage and getattr(payload, "usage", None) is None:
        body = body[:-1] + ',"usage":null}'
    return f"data: {body}\n\n"


async def _sse_stream(choices: ChoiceSet, chunks: Callable[[], AsyncIterator[BaseModel]], *,
                      include_usage: bool = False, heavy: bool = False) -> AsyncIterator[str]:
    """SSE framing; an engine failure after the 200 went out becomes an error event. With
    `include_usage`, every chunk before the usage one says `"usage": null`, as OpenAI's do.
    `heavy` (vocabulary-wide log-probs): each chunk is serialized off the event loop."""
    try:
        async for chunk in chunks():
            yield await off_the_loop_if(heavy, lambda: _sse(chunk, null_usage=include_usage))
    except APIError as exc:
        yield _sse(exc.body())
    yield "data: [DONE]\n\n"


def _ids_if(req: Any, ids: Sequence[int] | None) -> list[int] | None:
    """Token ids for the answer when the request asked for them (`return_token_ids`); None
    stays None (a prompt given as embeddings has no token ids)."""
    return list(ids) if req.return_token_ids and ids is not None else None


def _usage(prompt_tokens: int, choices: ChoiceSet, prompt_of: list[int] | None = None,
           prediction: list[int] | None = None, *, generated: bool = True) -> Usage:
    """Token counts. `prompt_of` maps requests to prompts (default: all one prompt); a prompt
    sent several times (n > 1) counts its cached tokens once, as its tokens. With a
    `prediction` (Predicted Outputs), how much of it the choices used. `generated` false: the
    completion tokens are not part of the answer (echo with max_tokens 0) and count 0."""
    results = choices.results()
    completion = sum(len(r.token_ids) for r in results) if generated else 0
    prompt_of = prompt_of or [0] * len(choices.handles)
    first_request = {p: r for r, p in reversed(list(enumerate(prompt_of)))}
    cached = sum(choices.handles[r].output.num_cached_tokens for r in first_request.values())
    details = None
    if prediction is not None:
        accepted, rejected = prediction_usage(prediction, [r.token_ids for r in results])
        details = CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                          rejected_prediction_tokens=rejected)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                 total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 completion_tokens_details=details)


def _running_usage(req: Any, prompt_tokens: int, completion_tokens: int) -> Usage | None:
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): every chunk carries
    its choice's counts so far."""
    options = req.stream_options
    if not (options and options.include_usage and options.continuous_usage_stats):
        return None
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


# ---- completions ---------------------------------------------------------------------------------

def _prompt_embeds(req: CompletionRequest, state: ServerState) -> list[Any] | None:
    """The request's `prompt_embeds` tensors (truncated as asked), or None when it sends text or
    token ids."""
    if req.prompt_embeds is None:
        return None
    embeds = decode_prompt_embeds(req.prompt_embeds, state.engine.model.hf_config.hidden_size,
                                  state.enable_prompt_embeds)
    if req.prompt is not None:
        raise bad_request("Give prompt or prompt_embeds, not both.", param="prompt_embeds")
    if req.echo:
        raise bad_request("echo needs a prompt to echo; prompt_embeds has no text.",
                          param="echo")
    return [truncated_prompt(rows, req.truncate_prompt_tokens, state.limits.max_model_len)
            for rows in embeds]


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, CompletionRequest)
    check_common(req, state)
    check_logprobs_cap(req.logprobs, state.max_logprobs, "logprobs",
                       state.limits.vocab_size)
    # echo with max_tokens 0 scores the prompt (OpenAI's legacy rule, vLLM's too): one token is
    # generated, for the engine, and left out of the answer.
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise bad_request("max_tokens must be at least 1; 0 is only for echo (scoring the prompt).",
                          param="max_tokens")
    # (Decoded off the event loop: base64 and unpickling a large tensor take a while.)
    embeds = await asyncio.to_thread(_prompt_embeds, req, state)
    if embeds is not None:  # the engine reads them; their token ids are placeholders
        prompts = [[0] * len(rows) for rows in embeds]
        prompt_ids: list[list[int] | None] = [None] * len(prompts)
    else:
        prompts = [truncated_prompt(ids, req.truncate_prompt_tokens, state.limits.max_model_len)
                   for ids in prompt_token_lists(req.prompt, state.tokenizer, state.limits,
                                                 add_special_tokens=req.add_special_tokens)]
        prompt_ids = list(prompts)  # what return_token_ids shows of each prompt
    if len(prompts) * req.n > MAX_CHOICES:
        raise bad_request(f"prompts x n must be at most {MAX_CHOICES} ({len(prompts)} prompt(s) "
                          f"x n = {req.n}).", param="n" if req.n > 1 else "prompt")
    spec, _ = await constraint(state, [from_response_format(req.response_format),
                                        *from_vllm_extras(req)], req)
    extra: dict[str, Any] = {}
    if spec is not None:
        extra["structured_output"] = spec
    # echo with logprobs: the prompt's tokens get logprobs too (the first one null), as many
    # alternatives as `logprobs` unless prompt_logprobs says (vLLM's rule: it wins).
    echo_logprobs = req.echo and req.logprobs is not None
    prompt_lp = req.prompt_logprobs if req.prompt_logprobs is not None \
        else req.logprobs if echo_logprobs else None
    if prompt_lp is not None:
        extra["prompt_logprobs"] = prompt_lp
    def max_tokens(ids: list[int]) -> int:
        if score_only and len(ids) >= state.limits.max_model_len:
            # The one token the engine generates needs a place in the context, which the
            # client did not ask for: said so, rather than "you requested N + 1 tokens".
            raise bad_request(
                f"This model's maximum context length is {state.limits.max_model_len} tokens. "
                f"However, your prompt resulted in {len(ids)} tokens; scoring a prompt (echo "
                f"with max_tokens 0) takes at most {state.limits.max_model_len - 1}. Please "
                "reduce the length of the prompt.", param="prompt",
                code="context_length_exceeded")
        return resolve_max_tokens(
            1 if score_only else req.max_tokens, len(ids), state.limits, "prompt",
            min(COMPLETIONS_DEFAULT_MAX_TOKENS,
                state.sampling_defaults.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS))

    jobs = plan_jobs(req, prompts, state, logprobs=req.logprobs, extra=extra,
                     max_tokens=max_tokens)
    if embeds is not None:
        jobs = jobs.with_prompts([{"prompt_embeds": rows} for rows in embeds])
    request_id = f"cmpl-{req.request_id or uuid.uuid4().hex}"
    texts = state.logprob_texts(req)
    heavy = heavy_logprobs(req.logprobs, prompt_lp)
    # Before submitting: a request refused here must not leave its choices running.
    echo_texts = ([state.text_tokenizer("echo").decode(p, skip_special_tokens=False)
                   for p in prompts] if req.echo else None)
    texts_by_prompt = [req.prompt] if isinstance(req.prompt, str) else (
        req.prompt if isinstance(req.prompt, list) and all(isinstance(p, str) for p in req.prompt)
        else [None] * len(prompts))
    choices = ChoiceSet.submit(state.engine, request_id, jobs.items,
                               state.request_observer if state.metrics is not None else None,
                               await request_fields(req, state, jobs), state.request_log,
                               [plugin_sees(state, prompt_text=texts_by_prompt[p])
                                for p in jobs.prompt_of])
    prompt_tokens = sum(len(p) for p in prompts)
    created = int(time.time())
    model = state.response_model(req.model)

    def prompt_entries(request_index: int) -> list[dict[str, Any] | None] | None:
        if prompt_lp is None:
            return None
        return prompt_logprobs_entries(choices.handles[request_index].output)

    if req.stream:
        include_usage = state.force_include_usage or bool(
            req.stream_options and req.stream_options.include_usage)
        request_of = [r for r, h in enumerate(choices.handles)
                      for _ in range(h.config.num_return_sequences)]

        async def chunks() -> AsyncIterator[BaseModel]:
            offsets = [TextOffsets() for _ in range(choices.num_choices)]  # per choice
            echoed = [echo_texts is None] * choices.num_choices
            # return_token_ids: each choice's first chunk carries its prompt's ids
            prompt_ids_sent = [not req.return_token_ids] * choices.num_choices
            generated = [0] * choices.num_choices
            async for ev in choices.events():
                r = request_of[ev.index]
                if score_only:  # the generated token is not part of the answer
                    ev.text, ev.logprobs, ev.token_ids = "", None, []
                    if ev.finish_reason is not None:  # out of tokens, whatever the one was
                        ev.finish_reason, ev.stop_reason = "length", None
                generated[ev.index] += ev.num_tokens
                usage = _running_usage(req, len(prompts[jobs.prompt_of[r]]), generated[ev.index])
                if not echoed[ev.index]:
                    # The prompt goes first, once its logprobs (computed at prefill) are known.
                    echoed[ev.index] = True
                    text = echo_texts[jobs.prompt_of[r]]
                    lp = None
                    if echo_logprobs:
                        lp = await off_the_loop_if(heavy, lambda: completion_prompt_logprobs(
                            prompt_entries(r), prompts[jobs.prompt_of[r]], texts,
                            offsets[ev.index]))
                    else:
                        offsets[ev.index] = TextOffsets(start=len(text))
                    prompt_ids_sent[ev.index] = True
                    # (its usage: no completion token yet; this event's come in the next chunk)
                    before = _running_usage(req, len(prompts[jobs.prompt_of[r]]),
                                            generated[ev.index] - ev.num_tokens)
                    yield CompletionResponse(id=request_id, created=created, model=model, choices=[
                        CompletionChoice(index=ev.index, text=text, logprobs=lp,
                                         prompt_token_ids=_ids_if(req, prompt_ids[jobs.prompt_of[r]]),
                                         token_ids=_ids_if(req, []))], usage=before)
                logprobs = None
                if ev.logprobs is not None:
                    logprobs = await off_the_loop_if(heavy, lambda: completion_logprobs(
                        ev.logprobs, texts, offsets[ev.index]))
                    logprobs = logprobs if logprobs.tokens else None
                if not ev.text and ev.finish_reason is None and logprobs is None \
                        and not (req.return_token_ids and ev.token_ids):
                    continue
                prompt_ids_now = None
                if not prompt_ids_sent[ev.index]:
                    prompt_ids_sent[ev.index] = True
                    prompt_ids_now = _ids_if(req, prompt_ids[jobs.prompt_of[r]])
                yield CompletionResponse(id=request_id, created=created, model=model, choices=[
                    CompletionChoice(index=ev.index, text=ev.text, logprobs=logprobs,
                                     finish_reason=ev.finish_reason, stop_reason=ev.stop_reason,
                                     prompt_token_ids=prompt_ids_now,
                                     token_ids=_ids_if(req, ev.token_ids))],
                    usage=usage)
            if include_usage:
                yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                         usage=_usage(prompt_tokens, choices, jobs.prompt_of,
                                                      generated=not score_only))

        return AbortOnCloseStreamingResponse(
            _sse_stream(choices, chunks, include_usage=include_usage, heavy=heavy), choices)

    if not await wait_for_choices(choices, request, state):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    kv_params = kv_response(state, choices)

    def choice_of(i: int, out: Any) -> CompletionChoice:
        if score_only:  # the generated token is not part of the answer
            out.text, out.token_ids, out.logprobs = "", [], out.logprobs and []
            out.finish_reason, out.stop_reason = "length", None
        p = jobs.prompt_of[out.request]
        prefix = echo_texts[p] if echo_texts is not None else ""
        entries = prompt_entries(out.request)
        logprobs = None
        if out.logprobs is not None:
            if echo_logprobs:
                offsets = TextOffsets()
                logprobs = completion_prompt_logprobs(entries, prompts[p], texts, offsets)
                generated = completion_logprobs(out.logprobs, texts, offsets)
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(logprobs, name).extend(getattr(generated, name))
            else:
                logprobs = completion_logprobs(out.logprobs, texts, TextOffsets(start=len(prefix)))
        return CompletionChoice(
            index=i, text=prefix + out.text, logprobs=logprobs, finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            prompt_logprobs=(vllm_prompt_logprobs(entries, prompts[p], texts)
                             if req.prompt_logprobs is not None else None),
            prompt_token_ids=_ids_if(req, prompt_ids[p]), token_ids=_ids_if(req, out.token_ids))

    def answer() -> JSONResponse:
        response = CompletionResponse(
            id=request_id, created=created, model=model,
            choices=[choice_of(i, out) for i, out in enumerate(choices.results())],
            usage=_usage(prompt_tokens, choices, jobs.prompt_of, generated=not score_only),
            kv_transfer_params=kv_params)
        return JSONResponse(response.model_dump())

    # (Heavy with vocabulary-wide log-probs: then built off the event loop.)
    return await off_the_loop_if(heavy, answer)


# ---- chat ----------------------------------------------------------------------------------------

@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, ChatCompletionRequest)
    run = await start_chat(req, state, f"chatcmpl-{req.request_id or uuid.uuid4().hex}")
    request_id, ids, choices, output_parser = run.request_id, run.ids, run.choices, run.output_parser
    created, model = run.created, run.model
    texts = state.logprob_texts(req)
    heavy = heavy_logprobs(req.top_logprobs if req.logprobs else None, req.prompt_logprobs)

    if req.stream:
        include_usage = state.force_include_usage or bool(
            req.stream_options and req.stream_options.include_usage)

        def chunk(choice: ChatStreamChoice, generated: int = 0) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice],
                                       usage=_running_usage(req, len(ids), generated))

        async def chunks() -> AsyncIterator[BaseModel]:
            parsers = [output_parser() for _ in range(choices.num_choices)]
            generated = [0] * choices.num_choices
            for i in range(choices.num_choices):
                first = chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role=run.role,
                                                                           content="")))
                first.prompt_token_ids = _ids_if(req, ids)  # (each choice's first chunk)
                yield first
                if run.echo:
                    yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=run.echo)))
            async for ev in choices.events():
                generated[ev.index] += ev.num_tokens
                parser = parsers[ev.index]
                delta = parser.feed(ev.text) if ev.text else ChatDelta()
                finish_reason = None
                if ev.finish_reason is not None:
                    delta = delta.then(parser.finish())
                    finish_reason = parser.finish_reason(ev.finish_reason)
                logprobs = await off_the_loop_if(heavy, lambda: chat_logprobs(
                    ev.logprobs, texts)) if ev.logprobs else None
                if not delta and finish_reason is None and logprobs is None \
                        and not (req.return_token_ids and ev.token_ids):
                    continue
                message = parser.delta_message(delta) if delta else DeltaMessage()
                yield chunk(ChatStreamChoice(index=ev.index, delta=message, logprobs=logprobs,
                                             finish_reason=finish_reason,
                                             stop_reason=ev.stop_reason if finish_reason else None,
                                             token_ids=_ids_if(req, ev.token_ids)),
                            generated[ev.index])
            if include_usage:
                yield ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                          usage=_usage(len(ids), choices,
                                                       prediction=run.prediction))

        return AbortOnCloseStreamingResponse(
            _sse_stream(choices, chunks, include_usage=include_usage, heavy=heavy), choices)

    if not await wait_for_choices(choices, request, state):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    kv_params = kv_response(state, choices)

    def choice_of(i: int, out: Any) -> ChatChoice:
        parser = output_parser()
        message = parser.message([parser.feed(out.text), parser.finish()])
        message.role = run.role
        if run.echo:
            message.content = run.echo + (message.content or "")
        logprobs = chat_logprobs(out.logprobs, texts) if out.logprobs is not None else None
        return ChatChoice(index=i, message=message, logprobs=logprobs,
                          finish_reason=parser.finish_reason(out.finish_reason),
                          stop_reason=out.stop_reason, token_ids=_ids_if(req, out.token_ids))

    def answer() -> JSONResponse:
        prompt_lps = None
        if req.prompt_logprobs is not None:
            prompt_lps = vllm_prompt_logprobs(prompt_logprobs_entries(choices.handles[0].output),
                                              ids, texts)
        response = ChatCompletionResponse(
            id=request_id, created=created, model=model,
            choices=[choice_of(i, out) for i, out in enumerate(choices.results())],
            usage=_usage(len(ids), choices, prediction=run.prediction),
            prompt_logprobs=prompt_lps, kv_transfer_params=kv_params,
            prompt_token_ids=_ids_if(req, ids))
        return JSONResponse(response.model_dump())

    # (Heavy with vocabulary-wide log-probs: then built off the event loop.)
    return await off_the_loop_if(heavy, answer)

