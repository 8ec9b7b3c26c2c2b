"""Request and response bodies of `POST /v1/embeddings` (OpenAI's embeddings API)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from ksana_llm.server.openai_protocol import ChatMessage, _Request

MAX_EMBEDDING_INPUTS = 2048  # inputs in one /v1/embeddings request, as OpenAI


class PoolingInputRequest(_Request):
    """What a request for last-token states (`/v1/embeddings`, `/classify`) computes. `input`: a
    string, a list of strings, a list of token ids or a list of token-id lists (OpenAI's four
    shapes); or, vLLM's chat form, `messages` rendered by the chat template into one input."""

    model: str | None = None
    # Typed loosely, like CompletionRequest.prompt: `prompt_token_lists` names the shapes.
    input: Any = None
    messages: list[ChatMessage] | None = None
    # The chat form's template settings (vLLM's defaults: no generation prompt).
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the tokenizer's special tokens (BOS, ...) around the text; None: True for `input`,
    # False for `messages` (the template writes its own).
    add_special_tokens: bool | None = None
    user: str | None = None
    # vLLM's: keep each input's last N tokens (-1: the model's context).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's: lower runs first; needs a server started with --scheduling-policy priority.
    priority: int = Field(0, ge=-(2**63), lt=2**63)


class EmbeddingRequest(PoolingInputRequest):
    """`POST /v1/embeddings`. `dimensions`: OpenAI's (only the model's own size is served, see
    `server.embeddings`); `normalize` (vLLM's): false gives the last-token state itself, not
    scaled to unit length."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool = True


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
