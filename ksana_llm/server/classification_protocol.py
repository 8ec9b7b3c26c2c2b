"""Request and response bodies of vLLM's classification API (`POST /classify`, also
`/v1/classify` as SGLang serves it)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from ksana_llm.server.embedding_protocol import PoolingInputRequest


class ClassificationRequest(PoolingInputRequest):
    """`POST /classify`: `input` (or `messages`) as on /v1/embeddings."""


class ClassificationData(BaseModel):
    index: int
    label: str  # id2label's name of the most probable class
    probs: list[float]
    num_classes: int


class ClassificationUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class ClassificationResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"classify-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: ClassificationUsage
