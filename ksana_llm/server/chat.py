"""Chat template rendering: OpenAI messages -> one prompt string.

Rendering goes through `transformers`' `apply_chat_template`, which runs Jinja in an immutable
sandbox. Only the server's template is used (the tokenizer's, or the operator's `--chat-template`
file): a template sent with a request is refused, because template injection is a known path to
server-side code execution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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


# How message content reaches the template (vLLM's --chat-template-content-format): "string"
# flattens text parts into one string; "openai" hands over a list of {"type": "text", ...} parts
# (templates of multimodal models loop over them); "auto" picks by reading the template.
CONTENT_FORMATS = ("auto", "string", "openai")
ContentFormat = Literal["string", "openai"]


@dataclass(frozen=True)
class ChatTemplate:
    """The template the server renders chats with, and how it wants message content."""

    text: str | None = None  # None: the tokenizer's own
    content_format: ContentFormat = "string"

    @classmethod
    def resolve(cls, text: str | None, content_format: str, tokenizer: Any) -> ChatTemplate:
        """`content_format` "auto" becomes "openai" when the template (or, without one, the
        tokenizer's) loops over a message's content, else "string"."""
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of "
                             f"{', '.join(CONTENT_FORMATS)}, got {content_format!r}")
        if content_format == "auto":
            source = text if text is not None else getattr(tokenizer, "chat_template", None)
            if isinstance(source, dict):  # named templates: chats render with the default one
                source = source.get("default")
            loops = isinstance(source, str) and loops_over_content(source)
            content_format = "openai" if loops else "string"
        return cls(text, content_format)  # type: ignore[arg-type]


def loops_over_content(template: str) -> bool:
    """Whether a Jinja template has a `{% for ... in <message>['content'] %}` loop (through
    filters, or a variable set from the content): such a template reads content as a list of
    parts, and iterating a string would hand it single characters."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError:
        return False  # rendering reports it, with the request that hit it

    def is_content(expr: nodes.Node, names: set[str]) -> bool:
        while isinstance(expr, (nodes.Filter, nodes.Test)):
            expr = expr.node
        if isinstance(expr, nodes.Getitem):
            return isinstance(expr.arg, nodes.Const) and expr.arg.value == "content"
        if isinstance(expr, nodes.Getattr):
            return expr.attr == "content"
        return isinstance(expr, nodes.Name) and expr.name in names

    content_names: set[str] = set()
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and is_content(assign.node, content_names):
            content_names.add(assign.target.name)
    return any(is_content(loop.iter, content_names) for loop in tree.find_all(nodes.For))


def _content_parts(message: ChatMessage, index: int) -> list[str]:
    """The text of each content part (a string content is one part)."""
    content = message.content
    param = f"messages.{index}.content"
    if content is None and message.role == "assistant" and message.refusal is not None:
        return [message.refusal]  # a refused turn: its refusal is what was said
    if isinstance(content, str):
        return [content]
    if content is None:
        raise bad_request("Message content is missing.", param=param)
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            # An assistant turn's refusal part reads as its text, as /v1/responses reads it.
            key = "refusal" if kind == "refusal" and message.role == "assistant" else "text"
            if kind is None:
                raise bad_request("A content part needs a `type` ('text').", param=f"{param}.{j}")
            if kind != key:
                raise bad_request(f"Content part of type {kind!r} is not supported; only 'text' parts.",
                                  param=f"{param}.{j}")
            if set(part) - {"type", key} or not isinstance(part.get(key), str):
                raise bad_request(f"A {key} part must be {{'type': '{key}', '{key}': <string>}}.",
                                  param=f"{param}.{j}")
            texts.append(part[key])
        return texts
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
        where = f"messages.{index}.tool_calls.{j}.function.arguments"
        if "arguments" not in fn:  # (OpenAI and vLLM refuse it too: a replayed call is whole)
            raise bad_request("A tool call's function needs its 'arguments' (JSON text).",
                              param=where)
        arguments = fn["arguments"]
        if not isinstance(arguments, (str, dict)):
            raise bad_request("A tool call's 'arguments' must be JSON text (or an object).",
                              param=where)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # the template gets the text as it is
        out.append({**call, "type": call.get("type", "function"),
                    "function": {**fn, "arguments": arguments}})
    return out


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as one string (its text parts joined), "" for none."""
    if message.content is None and message.refusal is None:
        return ""
    return "".join(_content_parts(message, index))


def _template_content(parts: list[str], content_format: ContentFormat) -> str | list[dict]:
    if content_format == "openai":
        return [{"type": "text", "text": text} for text in parts]
    return "".join(parts)  # OpenAI joins text parts without a separator when it flattens them


def to_template_messages(messages: list[ChatMessage], content_format: ContentFormat = "string"
                         ) -> list[dict[str, Any]]:
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
            parts = []  # a turn that only called tools
        else:
            parts = _content_parts(message, i)
        content = _template_content(parts, content_format)
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
            # GPT-OSS's template reads an earlier turn's reasoning as `thinking` (its analysis
            # channel), and refuses harmony tags in the content instead.
            entry["thinking"] = message.reasoning_content
        out.append(entry)
    return out


# The request fields that are template arguments too: given in chat_template_kwargs they win
# (vLLM applies chat_template_kwargs over the template arguments it builds from the fields).
TEMPLATE_FLAGS = ("add_generation_prompt", "continue_final_message")


def template_flags(add_generation_prompt: bool, continue_final_message: bool,
                   template_kwargs: dict[str, Any] | None
                   ) -> tuple[bool, bool, dict[str, Any]]:
    """(add_generation_prompt, continue_final_message, the other template kwargs): the request's
    fields, unless its chat_template_kwargs set them (true or false, else a 400 naming it)."""
    kwargs = dict(template_kwargs or {})
    flags = {"add_generation_prompt": add_generation_prompt,
             "continue_final_message": continue_final_message}
    for name in TEMPLATE_FLAGS:
        if name in kwargs:
            value = kwargs.pop(name)
            if not isinstance(value, bool):
                raise bad_request(f"`chat_template_kwargs.{name}` must be true or false.",
                                  param=f"chat_template_kwargs.{name}")
            flags[name] = value
    return flags["add_generation_prompt"], flags["continue_final_message"], kwargs


def render_chat(tokenizer: Any, messages: list[ChatMessage], template: ChatTemplate, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None,
                documents: list[dict[str, str]] | None = None) -> str:
    """The prompt text. `tools` (OpenAI tool definitions), `template_kwargs` (the request's
    chat_template_kwargs, e.g. enable_thinking, or the flags: `template_flags`) and `documents`
    (vLLM's, for RAG templates) are handed to the template."""
    add_generation_prompt, continue_final_message, template_kwargs = template_flags(
        add_generation_prompt, continue_final_message, template_kwargs)
    if template.text is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions or start the "
                          "server with --chat-template.", param="messages")
    try:
        return apply_chat_template(tokenizer, to_template_messages(messages, template.content_format),
                                   chat_template=template.text,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, tools=tools,
                                   chat_template_kwargs=template_kwargs, documents=documents)
    except ValueError as exc:
        raise engine_value_error(exc) from exc
