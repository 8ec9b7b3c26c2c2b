"""Chat template rendering: OpenAI messages -> one prompt string.

Rendering goes through `transformers`' `apply_chat_template`, which runs Jinja in an immutable
sandbox. Only the server's template is used (the tokenizer's, or the operator's `--chat-template`
file): a template sent with a request is refused, because template injection is a known path to
server-side code execution.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ksana_llm.api.chat import apply_chat_template
from ksana_llm.server.errors import bad_request
from ksana_llm.server.openai_protocol import ChatMessage
from ksana_llm.server.params import engine_value_error


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
    if content is None and message.role == "assistant" and message.refusal is not None:
        return message.refusal  # a refused turn: its refusal is what was said
    if isinstance(content, str):
        return content
    if content is None:
        raise bad_request("Message content is missing.", param=param)
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            # An assistant turn's refusal part reads as its text, as /v1/responses reads it.
            key = "refusal" if kind == "refusal" and message.role == "assistant" else "text"
            if kind != key:
                raise bad_request(f"Content part of type {kind!r} is not supported; only 'text' parts.",
                                  param=f"{param}.{j}")
            if set(part) - {"type", key} or not isinstance(part.get(key), str):
                raise bad_request(f"A {key} part must be {{'type': '{key}', '{key}': <string>}}.",
                                  param=f"{param}.{j}")
            texts.append(part[key])
        # OpenAI joins text parts without a separator when it flattens them.
        return "".join(texts)
    raise bad_request("Message content must be a string or a non-empty list of text parts.",
                      param=param)


def _template_tool_calls(calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """OpenAI tool calls as templates expect them: `arguments` as a mapping (HF convention),
    not the JSON text the API carries."""
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("A tool call must be {'id', 'type': 'function', 'function': "
                              "{'name', 'arguments'}}.", param=f"messages.{index}.tool_calls.{j}")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # the template gets the text as it is
        out.append({**call, "type": call.get("type", "function"),
                    "function": {**fn, "arguments": arguments}})
    return out


def to_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        for field in ("audio", "function_call"):
            if getattr(message, field) is not None:
                raise bad_request(f"`{field}` in a message is not supported (this server answers "
                                  "neither with audio nor with legacy function calls).",
                                  param=f"messages.{i}.{field}", code="unsupported_parameter")
        # "developer" is OpenAI's newer name for the system role; templates only know "system".
        role = "system" if message.role == "developer" else message.role
        if message.role == "assistant" and message.tool_calls and message.content is None:
            content = ""  # a turn that only called tools
        else:
            content = _content_text(message, i)
        entry: dict[str, Any] = {"role": role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request("Only assistant messages carry tool_calls.",
                                  param=f"messages.{i}.tool_calls")
            entry["tool_calls"] = _template_tool_calls(message.tool_calls, i)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        out.append(entry)
    return out


def render_chat(tokenizer: Any, messages: list[ChatMessage], template: str | None, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text. `tools` (OpenAI tool definitions) and `template_kwargs` (the request's
    chat_template_kwargs, e.g. enable_thinking) are handed to the template."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions or start the "
                          "server with --chat-template.", param="messages")
    try:
        return apply_chat_template(tokenizer, to_template_messages(messages), chat_template=template,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, tools=tools,
                                   chat_template_kwargs=template_kwargs)
    except ValueError as exc:
        raise engine_value_error(exc) from exc
