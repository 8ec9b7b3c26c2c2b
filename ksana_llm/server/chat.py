"""Chat template rendering: OpenAI messages -> one prompt string.

Rendering goes through `transformers`' `apply_chat_template`, which runs Jinja in an immutable
sandbox. Only the server's template is used (the tokenizer's, or the operator's `--chat-template`
file): a template sent with a request is refused, because template injection is a known path to
server-side code execution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ksana_llm.server.errors import bad_request
from ksana_llm.server.openai_protocol import ChatMessage


def load_chat_template(path: str | None) -> str | None:
    """The operator's template file (read once at start-up), or None for the tokenizer's own."""
    if path is None:
        return None
    text = Path(path).read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"chat template file {path} is empty")
    return text


def _content_text(message: ChatMessage, index: int) -> str:
    content = message.content
    param = f"messages.{index}.content"
    if isinstance(content, str):
        return content
    if content is None:
        raise bad_request("Message content is missing.", param=param)
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"Content part of type {kind!r} is not supported; only 'text' parts.",
                                  param=f"{param}.{j}")
            if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
                raise bad_request("A text part must be {'type': 'text', 'text': <string>}.",
                                  param=f"{param}.{j}")
            texts.append(part["text"])
        # OpenAI joins text parts without a separator when it flattens them.
        return "".join(texts)
    raise bad_request("Message content must be a string or a non-empty list of text parts.",
                      param=param)


def to_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        # "developer" is OpenAI's newer name for the system role; templates only know "system".
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": _content_text(message, i)}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out


def render_chat(tokenizer: Any, messages: list[ChatMessage], template: str | None, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    if add_generation_prompt and continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true.",
                          param="continue_final_message")
    if continue_final_message and messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs a final assistant message.",
                          param="continue_final_message")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions or start the "
                          "server with --chat-template.", param="messages")
    from jinja2 import TemplateError

    try:
        rendered = tokenizer.apply_chat_template(
            to_template_messages(messages), chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message)
    except TemplateError as exc:
        # Templates raise on messages they do not accept (e.g. roles out of order): client input.
        raise bad_request(f"The chat template rejected the messages: {exc}", param="messages") from exc
    if not isinstance(rendered, str) or not rendered:
        raise bad_request("The chat template rendered an empty prompt.", param="messages")
    return rendered
