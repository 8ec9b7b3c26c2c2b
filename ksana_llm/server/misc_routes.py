"""Small routes: /health (and /ping), /version, /v1/models (and one model), /v1/stats,
/tokenize, /detokenize, /reset_prefix_cache."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

import ksana_llm
from ksana_llm.server.chat import render_chat
from ksana_llm.api.engine import EngineDeadError
from ksana_llm.server.errors import bad_request, engine_unavailable, model_not_found
from ksana_llm.server.openai_protocol import ModelCard, ModelList
from ksana_llm.server.submission import parse_body
from ksana_llm.server.tokenize_protocol import (DetokenizeRequest, DetokenizeResponse,
                                                TokenizeRequest, TokenizeResponse)
from ksana_llm.server.params import check_token_ids
from ksana_llm.server.state import server_state
from ksana_llm.server.tools import plan_tools

router = APIRouter()


@router.get("/health")
@router.get("/ping")  # vLLM's and SageMaker's name for it
@router.post("/ping")
async def health(request: Request) -> JSONResponse:
    """200 while the engine serves, 503 once it is dead or the server is shutting down.

    The queue counts are there for load balancers and for tests that check aborts free the engine.
    """
    state = server_state(request)
    engine = state.engine
    if state.shutting_down or not engine.is_running:
        status = "shutting_down" if state.shutting_down else "dead"
        return JSONResponse({"status": status}, status_code=503)
    stats = engine.stats()
    # "healthy": KsanaLLM's body, which its probes compare.
    return JSONResponse({"status": "healthy", "num_running": stats.num_running,
                         "num_waiting": stats.num_waiting, "kv_cache_usage": stats.kv_cache_usage})


@router.get("/load")
async def load(request: Request) -> JSONResponse:
    """vLLM's server load: requests to the generation, embedding and scoring routes being
    answered now (streams until their end), for load balancers that route by it."""
    return JSONResponse({"server_load": server_state(request).load.in_flight})


@router.get("/v1/stats")
async def stats(request: Request) -> JSONResponse:
    """The engine's full statistics (debugging aid; guarded by the API key like every route),
    and a disaggregated server's KV-transfer counts under `kv_transfer`."""
    state = server_state(request)
    stats = state.engine.stats().as_dict()
    if state.kv_transfer is not None:
        stats["kv_transfer"] = state.kv_transfer.stats()
    return JSONResponse(stats)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> JSONResponse:
    """Forget every cached prompt prefix (vLLM's route), for cold-cache measurements; running
    requests go on undisturbed."""
    state = server_state(request)
    state.check_alive()  # a 503 on a dead or stopping engine, as for generation
    try:
        dropped = await asyncio.to_thread(state.engine.reset_prefix_cache)
    except EngineDeadError as exc:  # it died (or began to stop) in between
        raise engine_unavailable(str(exc)) from exc
    return JSONResponse({"num_blocks_dropped": dropped})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": ksana_llm.__version__})


def _model_cards(request: Request) -> list[ModelCard]:
    """The served model under each of its names, then the loaded LoRA adapters. `root` is
    where the weights came from, as vLLM gives it: the model's folder, an adapter's."""
    state = server_state(request)
    base = state.served_model_name
    limit, created = state.limits.max_model_len, state.started_at
    folder = str(state.engine.model.path)
    cards = [ModelCard(id=name, root=folder, max_model_len=limit, created=created)
             for name in (base, *state.model_aliases)]
    cards += [ModelCard(id=name, root=path, parent=base, max_model_len=limit, created=created)
              for name, path in state.engine.lora_adapters.items()]
    return cards


@router.get("/v1/models")
@router.get("/models")  # KsanaLLM serves it without the /v1 prefix too
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(ModelList(data=_model_cards(request)).model_dump())


@router.get("/v1/models/{model:path}")
@router.get("/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    """OpenAI's `models.retrieve`: one card, or a 404 naming `model` (names may hold slashes)."""
    for card in _model_cards(request):
        if card.id == model:
            return JSONResponse(card.model_dump())
    raise model_not_found(model)


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = server_state(request)
    req = await parse_body(request, TokenizeRequest)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("Give exactly one of `prompt` or `messages`.", param="prompt")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("`messages` must not be empty.", param="messages")
        # The tools as a chat request's template sees them (checked the same way).
        tools = plan_tools(req.tools, "none", parallel_tool_calls=None, auto_enabled=False,
                           parser=None).tools
        text = render_chat(state.text_tokenizer("messages"), req.messages, state.chat_template,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, tools=tools,
                           template_kwargs=state.chat_template_kwargs(req.chat_template_kwargs),
                           documents=req.documents)
        ids = state.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:
        if req.tools is not None:
            raise bad_request("`tools` go with `messages` (a chat template renders them).",
                              param="tools")
        ids = state.text_tokenizer("prompt").encode(req.prompt,
                                                    add_special_tokens=req.add_special_tokens
                                     is not False)
    strs = state.tokenizer.convert_ids_to_tokens(list(ids)) if req.return_token_strs else None
    return JSONResponse(TokenizeResponse(tokens=list(ids), count=len(ids), token_strs=strs,
                                         max_model_len=state.limits.max_model_len).model_dump())


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = server_state(request)
    req = await parse_body(request, DetokenizeRequest)
    state.check_model(req.model)
    check_token_ids(req.tokens, state.limits.vocab_size, "tokens")
    text = state.text_tokenizer("tokens").decode(req.tokens, skip_special_tokens=False)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
