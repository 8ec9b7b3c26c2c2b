"""vLLM's score API and the rerank API it serves, for any model this server embeds:

- `POST /score`, `/v1/score`: `text_1` against `text_2` (1:1, 1:N, or N:N by position), one
  score per pair;
- `POST /rerank`, `/v1/rerank`, `/v2/rerank` (Jina's and Cohere's shape): `documents` ordered
  by their score against `query`, best first, cut to `top_n`.

A score is the cosine similarity of the two texts' embeddings (`api.scoring`), as vLLM scores
with an embedding model; each text is embedded once, as `/v1/embeddings` would embed it, and
counted once in `usage` (vLLM embeds and counts a 1:N request's first text once per pair).
"""

from __future__ import annotations


import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ksana_llm.api.scoring import pair_scores, score_pairs
from ksana_llm.server.embeddings import embed_prompts, truncated_prompts
from ksana_llm.server.errors import bad_request
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


@router.post("/score")
@router.post("/v1/score")
async def create_scores(request: Request) -> JSONResponse:
    state = server_state(request)
    req = await parse_body(request, ScoreRequest)
    lora = state.check_model(req.model)
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
    scores = pair_scores(*embedded, pairs)
    tokens = sum(map(len, first)) + sum(map(len, second))
    response = ScoreResponse(model=state.response_model(req.model),
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
    query = truncated_prompts(req.query, "query", state, req.truncate_prompt_tokens)
    documents = truncated_prompts(req.documents, "documents", state, req.truncate_prompt_tokens)
    embedded = await _embed(state, ("query", query), ("documents", documents), request, lora,
                            req.priority)
    if embedded is None:
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
    scores = pair_scores(*embedded, score_pairs(1, len(documents)))
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=req.documents[i])
                            if req.return_documents else None)
               for i in order[:req.top_n if req.top_n and req.top_n > 0 else None]]
    tokens = len(query[0]) + sum(map(len, documents))
    response = RerankResponse(model=state.response_model(req.model),
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
                              results=results)
    return JSONResponse(response.model_dump(exclude_none=True))

