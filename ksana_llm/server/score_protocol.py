"""Request and response bodies of vLLM's score API (`/score`, `/v1/score`) and of the
Jina / Cohere rerank API vLLM serves (`/rerank`, `/v1/rerank`, `/v2/rerank`)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from ksana_llm.server.openai_protocol import _Request


class ScoreRequest(_Request):
    """`text_1` and `text_2`: a string or a list of strings each (token-id lists work too);
    one `text_1` is scored against every `text_2`, or two equally long lists pair by position."""

    model: str | None = None
    # Typed loosely, like EmbeddingRequest.input: `prompt_token_lists` names the shapes.
    text_1: Any = None
    text_2: Any = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # -1: the model's context
    user: str | None = None
    priority: int = Field(0, ge=-(2**63), lt=2**63)  # vLLM's, as on /v1/embeddings


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"score-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankRequest(_Request):
    """A `query` and the `documents` (strings) to order by their relevance to it; `top_n`
    keeps the best n (None, 0 or less: all of them, as vLLM)."""

    model: str | None = None
    query: str | None = None
    documents: list[str] | None = None
    top_n: int | None = None
    return_documents: bool = True  # Cohere's: False leaves each result's `document` out
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    user: str | None = None
    priority: int = Field(0, ge=-(2**63), lt=2**63)  # vLLM's, as on /v1/embeddings


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{uuid.uuid4().hex}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]
