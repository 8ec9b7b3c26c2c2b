"""Request and response bodies of vLLM's `POST /tokenize` and `POST /detokenize`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ksana_llm.server.openai_protocol import MAX_DOCUMENTS, ChatMessage, _Request


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: True for a prompt, False for messages (their template holds the special tokens).
    add_special_tokens: bool | None = None
    # With messages, as on /v1/chat/completions (vLLM's tokenize-chat fields).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)
    tools: Any = None  # with messages: rendered by the template, as on /v1/chat/completions
    return_token_strs: bool = False  # vLLM's: each token's string too


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
