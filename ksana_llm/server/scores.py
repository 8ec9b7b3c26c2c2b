"""vLLM's score API and the rerank API it serves, for any model this server embeds:

- `POST /score`, `/v1/score`: `text_1` against `text_2` (1:1, 1:N, or N:N by position), one
  score per pair;
- `POST /rerank`, `/v1/rerank`, `/v2/rerank` (Jina's and Cohere's shape): `documents` ordered
  by their score against `query`, best first, cut to `top_n`.

With a language model a score is the cosine similarity of the two texts' embeddings
(`api.scoring`), as vLLM scores with an embedding model; each text is embedded once, as
`/v1/embeddings` would embed it, and counted once in `usage` (vLLM embeds and counts a 1:N
request's first text once per pair). With a one-label sequence-classification model (a
cross-encoder reranker) each pair is read as one prompt (`api.scoring.cross_encoder_prompt`)
and scored with the model's probability, `usage` counting each pair's prompt.
"""

from __future__ import annotations

from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ksana_llm.api.scoring import cross_encoder_prompt, pair_scores, score_pairs
from ksana_llm.server.classification import checked_classifier, classify_prompts
from ksana_llm.server.embeddings import embed_prompts, truncated_prompts
from ksana_llm.server.errors import bad_request
from ksana_llm.server.params import prompt_token_lists
from ksana_llm.server.score_protocol import (RerankDocument, RerankRequest, RerankResponse,
                                             RerankResult, RerankUsage, ScoreData, ScoreRequest,
                                             ScoreResponse, ScoreUsage)
from ksana_llm.server.state import ServerState, server_state
from ksana_llm.server.submission import CLIENT_CLOSED_REQUEST, parse_body

router = APIRouter()

# Texts one request may score: each is a forward pass, as an embeddings input is.
MAX_SCORE_TEXTS = 2048


async def _embed(state: ServerState, first: tuple[str, list[list[int]]],
                 second: tuple[str, list[list[int]]], request: Request, lora: str | None,
                 priority: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The embeddings of two named lists of texts as [n, hidden] tensors; None when the client
    left. A text the engine refuses (too long for the model) is a 400 naming its list."""
    (first_name, first_texts), (second_name, second_texts) = first, second
    if len(first_texts) + len(second_texts) > MAX_SCORE_TEXTS:
        raise bad_request(f"At most {MAX_SCORE_TEXTS} texts per request; got "
                          f"{len(first_texts) + len(second_texts)}.", param=second_name)
    fields = [first_name] * len(first_texts) + [second_name] * len(second_texts)
    vectors = await embed_prompts(state, first_texts + second_texts, request, lora, fields,
                                  priority)
    if vectors is None:
        return None
    stacked = torch.stack(vectors)
    return stacked[:len(first_texts)], stacked[len(first_texts):]


def _texts(value: Any, field: str, state: ServerState) -> list[str | list[int]]:
    """A cross-encoder's texts as given: strings stay strings (a pair is tokenized together),
    token-id lists as checked by `prompt_token_lists` (which refuses every bad shape)."""
    checked = prompt_token_lists(value, state.tokenizer, state.limits, field=field,
                                 add_special_tokens=False)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(text, str) for text in value):
        return list(value)
    return list(checked)


async def _cross_encoder_scores(state: ServerState, first: tuple[str, Any],
                                second: tuple[str, Any], keep: int | None, request: Request,
                                lora: str | None, priority: int
                                ) -> tuple[list[float], int] | None:
    """(each pair's score, the tokens computed) from a one-label classification model; None
    when the client left. Pairs as `score_pairs` forms them (a shape error names `second`)."""
    head = checked_classifier(state, "score")
    if head.num_labels != 1:
        raise bad_request(f"This classification model has {head.num_labels} labels; scoring "
                          "pairs needs a one-label model (a cross-encoder).", param="model",
                          code="model_not_supported")
    (first_name, first_value), (second_name, second_value) = first, second
    first_texts = _texts(first_value, first_name, state)
    second_texts = _texts(second_value, second_name, state)
    try:
        pairs = score_pairs(len(first_texts), len(second_texts), first=first_name,
                            second=second_name)
    except ValueError as exc:
        raise bad_request(str(exc), param=second_name) from exc
    if len(pairs) > MAX_SCORE_TEXTS:
        raise bad_request(f"At most {MAX_SCORE_TEXTS} pairs per request; got {len(pairs)}.",
                          param=second_name)
    joined = [cross_encoder_prompt(state.tokenizer, first_texts[i], second_texts[j])
              for i, j in pairs]
    prompts = truncated_prompts(joined, second_name, state, keep,
                                what=f"pair of {first_name} and {second_name} (read together)")
    outputs = await classify_prompts(state, prompts, request, lora, [second_name] * len(pairs),
                                     priority)
    if outputs is None:
        return None
    return [out.probs[0] for out in outputs], sum(map(len, prompts))


@router.post("/score")
@router.post("/v1/score")
async def create_scores(request: Request) -> JSONResponse:
    state = server_state(request)
    req = await parse_body(request, ScoreRequest)
    lora = state.check_model(req.model)
    if state.engine.model.classifier is not None:
        scored = await _cross_encoder_scores(state, ("text_1", req.text_1),
                                             ("text_2", req.text_2), req.truncate_prompt_tokens,
                                             request, lora, req.priority)
        if scored is None:
            return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
        return _score_response(state, req.model, *scored)
    first = truncated_prompts(req.text_1, "text_1", state, req.truncate_prompt_tokens)
    second = truncated_prompts(req.text_2, "text_2", state, req.truncate_prompt_tokens)
    try:
        pairs = score_pairs(len(first), len(second))
    except ValueError as exc:
        raise bad_request(str(exc), param="text_2") from exc
    embedded = await _embed(state, ("text_1", first), ("text_2", second), request, lora,
                            req.priority)
    if embedded is None:
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
    return _score_response(state, req.model, pair_scores(*embedded, pairs),
                           sum(map(len, first)) + sum(map(len, second)))


def _score_response(state: ServerState, model: str | None, scores: list[float],
                    tokens: int) -> JSONResponse:
    response = ScoreResponse(model=state.response_model(model),
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(response.model_dump())


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request) -> JSONResponse:
    state = server_state(request)
    req = await parse_body(request, RerankRequest)
    lora = state.check_model(req.model)
    if req.query is None:
        raise bad_request("`query` is required.", param="query")
    if not req.documents:
        raise bad_request("`documents` must be a non-empty list of strings.", param="documents")
    if state.engine.model.classifier is not None:
        scored = await _cross_encoder_scores(state, ("query", req.query),
                                             ("documents", req.documents),
                                             req.truncate_prompt_tokens, request, lora,
                                             req.priority)
        if scored is None:
            return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
        scores, tokens = scored
    else:
        query = truncated_prompts(req.query, "query", state, req.truncate_prompt_tokens)
        documents = truncated_prompts(req.documents, "documents", state,
                                      req.truncate_prompt_tokens)
        embedded = await _embed(state, ("query", query), ("documents", documents), request,
                                lora, req.priority)
        if embedded is None:
            return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
        scores = pair_scores(*embedded, score_pairs(1, len(documents)))
        tokens = len(query[0]) + sum(map(len, documents))
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=req.documents[i])
                            if req.return_documents else None)
               for i in order[:req.top_n if req.top_n and req.top_n > 0 else None]]
    response = RerankResponse(model=state.response_model(req.model),
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
                              results=results)
    return JSONResponse(response.model_dump(exclude_none=True))

