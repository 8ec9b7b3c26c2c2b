"""What the generating routes share between parsing a request and shaping its answer: body
parsing, the common checks, compiling an output constraint, planning the engine requests behind
`n` choices, the LoRA / KV-transfer request fields, and waiting for (or streaming) the choices
with the request aborted however the response ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.server import kv_transfer
from ksana_llm.server.errors import bad_request, count_failure, from_validation_error
from ksana_llm.server.generation import ChoiceSet, ClientDisconnected
from ksana_llm.server.openai_protocol import _SamplingRequest
from ksana_llm.server.params import (
    bad_words_ids,
    beam_search_fields,
    check_logprobs_cap,
    check_token_ids,
    choice_seeds,
    engine_samples_n,
    generation_config,
    resolve_max_tokens,
)
from ksana_llm.server.state import ServerState
from ksana_llm.server.structured_params import (StructuredRequest, compile_spec,
                                                refuse_with_beam_search, single)

RequestModel = TypeVar("RequestModel", bound=BaseModel)
_Result = TypeVar("_Result")

# Status for a client that left before its answer (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499

async def parse_body(request: Request, model: type[RequestModel]) -> RequestModel:
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def check_common(req: _SamplingRequest, state: ServerState) -> None:
    state.check_model(req.model)
    unsupported = req.unsupported_params()
    if unsupported:
        raise bad_request(f"Unsupported parameter(s): {', '.join(unsupported)}.",
                          param=unsupported[0], code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")
    check_logprobs_cap(req.prompt_logprobs, state.max_logprobs, "prompt_logprobs",
                       state.limits.vocab_size)
    if req.truncate_prompt_tokens == 0:
        raise bad_request("truncate_prompt_tokens must be -1 (the model's context) or >= 1.",
                          param="truncate_prompt_tokens")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available when streaming.", param="prompt_logprobs")
    if req.best_of is not None:
        if req.best_of < req.n:
            raise bad_request(f"`best_of` ({req.best_of}) must be at least `n` ({req.n}).",
                              param="best_of")
        if req.stream and req.best_of > req.n:
            raise bad_request("`best_of` cannot be used with streaming.", param="best_of")
    state.check_alive()


async def constraint(state: ServerState, found: list[StructuredRequest | None],
                     req: _SamplingRequest) -> tuple[Any, str | None]:
    """The compiled spec of the request's one output constraint (None, None without one)."""
    request = single(found)
    refuse_with_beam_search(request, beam_search_fields(req) is not None)
    if request is None:
        return None, None
    return await compile_spec(state, request), request.kind


@dataclass
class Jobs:
    """Engine requests for a list of prompts, and which prompt each request answers."""

    # A prompt is its token ids, or a prompt dict (`Request.of`: {"prompt_embeds": tensor}).
    items: list[tuple[list[int] | dict[str, Any], GenerationConfig]]
    prompt_of: list[int]  # request index -> prompt index

    def with_prompts(self, prompts: list[Any]) -> Jobs:
        """The same requests for other prompts (one per prompt index)."""
        return Jobs([(prompts[p], config) for p, (_, config) in zip(self.prompt_of, self.items)],
                    self.prompt_of)


def plan_jobs(req: _SamplingRequest, prompts: list[list[int]], state: ServerState, *,
               max_tokens: Callable[[list[int]], int], logprobs: int | None,
               extra: dict[str, Any]) -> Jobs:
    """The engine requests behind `n` choices per prompt.

    Beam search, best_of and plain `n > 1` run as one engine request returning `n` sequences,
    which share the prompt's KV blocks (sequence i of a seeded request samples with seed + i).
    An engine without parallel sampling gets `n` requests with seeds seed + i instead.
    """
    beam = beam_search_fields(req)
    if beam is None:
        req = state.sampling_defaults.fill(req)  # the model's defaults for what it left out
    fields = dict(extra)
    if req.bad_words:
        fields["bad_words_ids"] = bad_words_ids(req.bad_words, state.text_tokenizer("bad_words"))
    if req.allowed_token_ids is not None:
        check_token_ids(req.allowed_token_ids, state.limits.vocab_size, "allowed_token_ids")
        fields["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.vllm_xargs:
        fields["extra_args"] = dict(req.vllm_xargs)
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
    check_fits_queue(state, len(prompts), len(seeds))
    return Jobs(items, prompt_of)


def check_fits_queue(state: ServerState, num_prompts: int, per_prompt: int) -> None:
    """400 for a request with more engine requests (prompts x n) than the engine ever takes at
    once, max_num_seqs + max_queue_size: they are submitted all or none, so it would be a 429
    on an idle server too, and on every retry. Checked before anything is submitted."""
    config = state.engine.config
    limit = config.max_num_seqs + config.max_queue_size
    needed = num_prompts * per_prompt
    if needed <= limit:
        return
    param = "prompt" if num_prompts > limit else "n"
    raise bad_request(f"This request needs {needed} engine requests ({num_prompts} prompt(s) x "
                      f"{per_prompt}), more than this server ever takes at once: max_num_seqs + "
                      f"max_queue_size = {config.max_num_seqs} + {config.max_queue_size} = "
                      f"{limit}. Send fewer prompts or choices per request.", param=param)


class AbortOnCloseStreamingResponse(StreamingResponse):
    """Aborts the choices however the response ends: finished, client gone, or never started;
    and counts the failure an engine error mid-stream became (an error event after the 200,
    which the error handlers never see)."""

    def __init__(self, content: AsyncIterator[str], choices: ChoiceSet) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.abort_unfinished()
            if self._choices.failure is not None:
                count_failure(scope.get("app"), self._choices.failure)


# The refusal's code, which tells a router to send the request to a decode server whole.
LORA_NOT_TRANSFERABLE = "lora_kv_not_transferable"


def checked_priority(priority: int, state: ServerState) -> int:
    """A request's `priority`; as vLLM, one the FIFO scheduler would silently ignore is a 400."""
    if priority and not state.engine.scheduling_policy.uses_priority:
        raise bad_request("`priority` needs a server started with --scheduling-policy "
                          "priority (or a policy that ranks by priority).", param="priority")
    return priority


def plugin_sees(state: ServerState, **sources: Any) -> dict[str, Any]:
    """`Request` fields (`prompt_text`, `messages`) that show a model plugin what the token ids
    were made from (its `preprocess` gets them as `prompt` and `messages`); none without one."""
    if getattr(state.engine.model, "plugin", None) is None:
        return {}
    return {key: value for key, value in sources.items() if value is not None}


async def request_fields(req: _SamplingRequest, state: ServerState, jobs: Jobs
                          ) -> dict[str, Any]:
    """Engine `Request` fields for the request's LoRA adapter (its `model`), its `priority`,
    `cache_salt` and `kv_transfer_params` (see server.kv_transfer)."""
    lora = state.check_model(req.model)
    fields: dict[str, Any] = {} if lora is None else {"lora": lora}
    if req.cache_salt is not None:
        fields["cache_salt"] = req.cache_salt
    if req.priority:
        fields["priority"] = checked_priority(req.priority, state)
    if req.kv_transfer_params is None:
        return fields
    if lora is not None:
        # The transferred KV does not say which adapter computed it; a router that sees this
        # refusal sends the request to a decode server whole.
        raise bad_request("kv_transfer_params cannot be used with a LoRA adapter.",
                          param="kv_transfer_params", code=LORA_NOT_TRANSFERABLE)
    prompt_param = "messages" if hasattr(req, "messages") else "prompt"

    def check_room(max_tokens: int) -> None:
        for prompt, _ in jobs.items:
            if isinstance(prompt, list):
                resolve_max_tokens(max_tokens, len(prompt), state.limits, prompt_param)

    # Beside the request's own fields (its cache_salt and priority hold on either side of a
    # transfer), not instead of them.
    return {**fields, **await kv_transfer.request_fields(
        req.kv_transfer_params, state.kv_transfer,
        num_sequences=sum(config.num_sequences for _, config in jobs.items),
        stream=req.stream, check_room=check_room)}


def kv_response(state: ServerState, choices: ChoiceSet) -> dict[str, Any] | None:
    if len(choices.handles) != 1:
        return None
    return kv_transfer.response_params(state.kv_transfer, choices.handles[0].output)


async def wait_for_choices(choices: ChoiceSet, request: Request, state: ServerState) -> bool:
    """Wait for every choice; False if the client left first (not a failure: its requests end
    aborted, and the metrics count them as finished with reason "abort")."""
    try:
        await choices.wait(request)
    except ClientDisconnected:
        return False
    return True


# Alternatives per position from which an answer's log-probs are formatted and serialized off
# the event loop: vocabulary-wide ones (-1) take seconds, in which no other client is served.
HEAVY_LOGPROBS = 100


def heavy_logprobs(*counts: int | None) -> bool:
    return any(c is not None and (c == -1 or c >= HEAVY_LOGPROBS) for c in counts)


async def off_the_loop_if(heavy: bool, fn: Callable[[], _Result]) -> _Result:
    """`fn()`, in a worker thread when `heavy`, so that the event loop serves others meanwhile."""
    return await asyncio.to_thread(fn) if heavy else fn()
