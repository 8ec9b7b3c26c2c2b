"""`POST /v1/embeddings`: one vector per input, as OpenAI's (and vLLM's) embeddings API; each is
`Engine.embed`'s (`api.embeddings`: the last token's final-norm state, L2-normalised).

`encoding_format: "base64"` (what the `openai` client asks for by default) sends each vector as
base64 of its little-endian float32 bytes. `dimensions` must be the model's hidden size: cutting
a vector short only means something for models trained for it (Matryoshka), so it is refused
rather than done badly, as vLLM does for other models.

Inputs are queued as the queue allows (waiting for room, as `Engine.embed` does), so a request
with more inputs than max_num_seqs + max_queue_size (up to the 2,048 allowed) runs rather than
getting a 429 no retry could clear.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ksana_llm.api.embeddings import (EMBEDDING_TARGETS, TOKEN_STATE_TARGETS,
                                      embedding_from_hidden, token_embeddings_from_hidden)
from ksana_llm.api.forward_outputs import ForwardTarget
from ksana_llm.api.forward_outputs import ForwardHandle
from ksana_llm.server.embedding_protocol import (MAX_EMBEDDING_INPUTS, EmbeddingData,
                                                 EmbeddingRequest, EmbeddingResponse,
                                                 EmbeddingUsage, PoolingInputRequest)
from ksana_llm.server.chat import render_chat
from ksana_llm.server.errors import bad_request
from ksana_llm.server.generation import run_forward
from ksana_llm.server.submission import CLIENT_CLOSED_REQUEST, checked_priority, parse_body
from ksana_llm.server.params import context_length_exceeded, prompt_token_lists, truncated_prompt
from ksana_llm.server.state import ServerState, server_state

router = APIRouter()


def encode_vector(vector: torch.Tensor, encoding_format: str
                  ) -> list[float] | list[list[float]] | str:
    """A vector (or a [tokens, size] matrix) as the response sends it: floats (nested lists for
    a matrix), or base64 of little-endian float32, a matrix's rows one after the other."""
    if encoding_format == "base64":
        data = vector.numpy().astype("<f4", copy=False).tobytes()
        return base64.b64encode(data).decode("ascii")
    return vector.tolist()


def truncated_prompts(value: Any, field: str, state: ServerState, keep: int | None,
                      add_special_tokens: bool = True, what: str | None = None
                      ) -> list[list[int]]:
    """`value`'s prompts as token ids, each cut to its last `keep` tokens (vLLM's
    truncate_prompt_tokens; -1: the model's context; None: whole). `what`: the prompts' name
    in a too-long error, when more than `field` (a cross-encoder's joined pairs)."""
    if keep == 0:
        raise bad_request("truncate_prompt_tokens must be -1 (the model's context) or >= 1.",
                          param="truncate_prompt_tokens")
    prompts = prompt_token_lists(value, state.tokenizer, state.limits, field=field,
                                 add_special_tokens=add_special_tokens)
    cut = [truncated_prompt(ids, keep, state.limits.max_model_len) for ids in prompts]
    longest = max(map(len, cut), default=0)
    if longest > state.limits.max_model_len:  # (a forward pass may fill the whole context)
        raise context_length_exceeded(state.limits.max_model_len, longest, field,
                                      ", or set truncate_prompt_tokens", what=what)
    return cut


def pooling_inputs(req: PoolingInputRequest, state: ServerState) -> list[list[int]]:
    """The token ids of an embeddings (or classification) request's `input` or `messages`."""
    if (req.input is None) == (req.messages is None):
        raise bad_request("Give exactly one of `input` or `messages`.", param="input")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("`messages` must not be empty.", param="messages")
        text = render_chat(state.text_tokenizer("messages"), req.messages, state.chat_template,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           template_kwargs=state.chat_template_kwargs(req.chat_template_kwargs))
        return truncated_prompts(text, "messages", state, req.truncate_prompt_tokens,
                                 add_special_tokens=bool(req.add_special_tokens))
    prompts = truncated_prompts(req.input, "input", state, req.truncate_prompt_tokens,
                                add_special_tokens=req.add_special_tokens is not False)
    if len(prompts) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"At most {MAX_EMBEDDING_INPUTS} inputs per request; got "
                          f"{len(prompts)}.", param="input")
    return prompts


def _submitter(state: ServerState, prompts: list[list[int]], loop: asyncio.AbstractEventLoop,
               lora: str | None, fields: Sequence[str], priority: int,
               targets: Sequence[ForwardTarget]) -> Callable[[int], ForwardHandle]:
    """What queues input i (a prompt the engine refuses is a 400 naming `fields[i]`)."""
    base = f"embd-{uuid.uuid4().hex}"

    def submit(i: int) -> ForwardHandle:
        try:
            return state.engine.submit_forward(prompts[i], list(targets),
                                               request_id=f"{base}-{i}", loop=loop, lora=lora,
                                               priority=priority)
        except ValueError as exc:  # too long for the model, ...
            raise bad_request(str(exc), param=fields[i]) from exc

    return submit


async def final_hidden_states(state: ServerState, prompts: list[list[int]], request: Request,
                              lora: str | None, fields: Sequence[str] | None = None,
                              priority: int = 0, every_token: bool = False
                              ) -> list[torch.Tensor] | None:
    """Each prompt's last-token hidden state after the final norm, in order; None when the
    client left first (its requests aborted and counted). `fields`: each prompt's field name
    for errors (default: all `input`). `priority`: the request's (checked against the
    scheduler). What embeddings, scores and classifications are made of. `every_token`: each
    prompt's states at all its positions instead, [tokens, hidden] (the per-token tasks)."""
    fields = fields if fields is not None else ["input"] * len(prompts)
    submit = _submitter(state, prompts, asyncio.get_running_loop(), lora, fields,
                        checked_priority(priority, state),
                        TOKEN_STATE_TARGETS if every_token else EMBEDDING_TARGETS)
    outputs = await run_forward(state.engine, submit, len(prompts), request)
    state.count_forward_outputs(outputs)
    return None if outputs is None else [out.targets[0].tensor for out in outputs]


async def embed_prompts(state: ServerState, prompts: list[list[int]], request: Request,
                        lora: str | None, fields: Sequence[str] | None = None,
                        priority: int = 0, normalize: bool = True
                        ) -> list[torch.Tensor] | None:
    """Each prompt's embedding (`api.embeddings`), in order; None when the client left first.
    As `final_hidden_states`; also what `/score` and `/rerank` compare. `normalize` False: the
    last-token states as they are (float32), not scaled to unit length."""
    states = await final_hidden_states(state, prompts, request, lora, fields, priority)
    if states is None:
        return None
    return [embedding_from_hidden(hidden) if normalize else hidden.float().flatten()
            for hidden in states]


async def embed_tokens(state: ServerState, prompts: list[list[int]], request: Request,
                       lora: str | None, priority: int = 0, normalize: bool = True
                       ) -> list[torch.Tensor] | None:
    """Each prompt's per-token embeddings [tokens, hidden] (vLLM's token_embed: every
    position's final-norm state, each row L2-normalised unless `normalize` is False), in order;
    None when the client left first."""
    states = await final_hidden_states(state, prompts, request, lora, priority=priority,
                                       every_token=True)
    if states is None:
        return None
    return [token_embeddings_from_hidden(rows) if normalize else rows.float()
            for rows in states]


def check_dimensions(dimensions: int | None, state: ServerState) -> None:
    """A 400 naming `dimensions` unless it is None or the model's hidden size."""
    hidden_size = int(state.engine.model.hf_config.hidden_size)
    if dimensions is not None and dimensions != hidden_size:
        raise bad_request(f"This model's embeddings have {hidden_size} dimensions and cannot be "
                          f"shortened to {dimensions}.", param="dimensions",
                          code="unsupported_parameter")


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> JSONResponse:
    state = server_state(request)
    req = await parse_body(request, EmbeddingRequest)
    lora = state.check_model(req.model)
    check_dimensions(req.dimensions, state)
    prompts = pooling_inputs(req, state)
    vectors = await embed_prompts(state, prompts, request, lora, priority=req.priority,
                                  normalize=req.normalize)
    if vectors is None:  # the client left; its requests were aborted
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
    data = [EmbeddingData(index=i, embedding=encode_vector(vector, req.encoding_format))
            for i, vector in enumerate(vectors)]
    tokens = sum(map(len, prompts))
    response = EmbeddingResponse(data=data, model=state.response_model(req.model),
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(response.model_dump())
