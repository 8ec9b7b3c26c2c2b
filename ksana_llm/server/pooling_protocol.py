"""Request and response bodies of vLLM's pooling API (`POST /pooling`)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from ksana_llm.server.classification_protocol import ClassificationUsage
from ksana_llm.server.embedding_protocol import EmbeddingRequest


class PoolingRequest(EmbeddingRequest):
    """`input` (or `messages`), `dimensions` and `normalize` as on /v1/embeddings. `task`: what
    to pool, "embed" (the embedding /v1/embeddings gives) or "classify" (the class
    probabilities /classify gives), or per token: "token_embed" (every position's embedding,
    [tokens, hidden]) or "token_classify" (every position's class probabilities,
    [tokens, classes]); None: the model's own, classify for a sequence-classification model,
    else embed."""

    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    # per-token tasks: a list per token; str: base64 of little-endian float32 (rows in order)
    data: list[float] | list[list[float]] | str


class PoolingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"pool-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: ClassificationUsage
