"""The OpenAI Responses API's request, and its translation to and from the chat route's terms.

A Responses request is a chat request in other clothes: `input` items become chat messages (an
`instructions` string goes first, as a system message), flat function tools become chat tools,
`text.format` becomes `response_format`. The answer goes the other way: the chat output parser's
reasoning, text and tool calls become `reasoning`, `message` and `function_call` output items.
Errors name the Responses parameter (`input.2.content`, `tools.0.name`, `text.format`).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from ksana_llm.server.errors import APIError, bad_request
from ksana_llm.server.openai_protocol import MAX_LOGPROBS, ChatMessage, _Request

# `include` values: the one that changes the answer, and those accepted with nothing to add
# (this server keeps no encrypted reasoning, files, images or hosted tools).
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_IGNORED_INCLUDES = frozenset({"reasoning.encrypted_content"})
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_INPUT_ROLES = ("user", "system", "developer", "assistant")
_FUNCTION_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
# Function-tool fields of OpenAI's hosted features, accepted and dropped.
_IGNORED_TOOL_KEYS = frozenset({"defer_loading", "allowed_callers", "output_schema"})


class ResponsesRequest(_Request):
    model: str | None = None
    input: Any = None  # a string, or a list of items; checked by `input_messages`
    # (may be left out when previous_response_id continues a conversation)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    tools: list[Any] | None = None  # function tools; checked by `chat_tools`
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    # echoed; `effort` goes to the chat template as `reasoning_effort` (as the chat route's)
    reasoning: dict[str, Any] | None = None
    store: bool | None = True  # None (the SDK's null): true, as OpenAI
    previous_response_id: str | None = None
    # OpenAI's limits: 16 pairs, keys of at most 64 characters, values of at most 512.
    metadata: dict[Annotated[str, StringConstraints(max_length=64)],
                   Annotated[str, StringConstraints(max_length=512)]] | None = Field(
        None, max_length=16)
    truncation: Literal["auto", "disabled"] | None = None
    # Accepted and ignored: they do not change what is generated.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    prompt_cache_options: Any = None
    # A cap on calls to OpenAI's built-in (hosted) tools, of which this server runs none.
    max_tool_calls: int | None = Field(None, ge=0)
    # Answer at once and run on (GET /v1/responses/{id} polls, POST .../cancel stops it).
    background: bool | None = None
    # Refused when set (see `unsupported_params`).
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    access_programs: Any = None
    image: Any = None
    moderation: Any = None
    # vLLM extras (sampling parameters the chat route also takes).
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    priority: int = Field(0, ge=-(2**63), lt=2**63)
    cache_salt: str | None = Field(None, min_length=1)

    @property
    def reasoning_effort(self) -> str | None:
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise bad_request(f"`reasoning.effort` must be one of {', '.join(REASONING_EFFORTS)}.",
                              param="reasoning.effort")
        return effort

    def unsupported_params(self) -> list[str]:
        found = [name for name in ("background_options", "conversation", "prompt",
                                   "context_management", "access_programs", "image",
                                   "moderation") if getattr(self, name)]
        return found

    def check_include(self) -> None:
        """An `include` value this server has nothing for is a 400 naming it (the known ones
        listed)."""
        unknown = sorted(set(self.include or ()) - _IGNORED_INCLUDES - {LOGPROBS_INCLUDE})
        if unknown:
            known = ", ".join(sorted({LOGPROBS_INCLUDE, *_IGNORED_INCLUDES}))
            raise bad_request(f"Unsupported include value(s): {', '.join(unknown)} (supported: "
                              f"{known}).", param="include", code="unsupported_parameter")

    @property
    def wants_logprobs(self) -> bool:
        # Asked for by `include` alone, as OpenAI and vLLM do: `top_logprobs` only says how
        # many alternatives each token then lists.
        return LOGPROBS_INCLUDE in (self.include or ())


def _parts_text(content: Any, role: str, param: str) -> str:
    """An input message's content: a string, or a list of text parts joined as they are."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad_request("Message content must be a string or a non-empty list of parts.",
                          param=param)
    kind = "output_text" if role == "assistant" else "input_text"
    texts = []
    for j, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if part_type != kind:
            raise bad_request(f"Content part {part_type or type(part).__name__!r} is not supported"
                              f" here; {role} content takes {kind!r} parts.", param=f"{param}.{j}")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"An {kind!r} part needs its `text`, a string.",
                              param=f"{param}.{j}.text")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"`{key}` must be a string.", param=f"{param}.{key}")
    return value


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                              for p in parts):
        raise bad_request("A reasoning item's content must be a list of text parts.",
                          param=f"{param}.content")
    return "".join(p["text"] for p in parts)


def input_messages(value: Any, param: str = "input") -> list[ChatMessage]:
    """Input items -> chat messages. A function call joins the assistant message before it (the
    chat form of one turn that wrote text and called tools); a reasoning item rides on the next
    assistant message (templates that show earlier thinking read it)."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    if not isinstance(value, list) or not value:
        raise bad_request("`input` must be a string or a non-empty list of items.", param=param)
    messages: list[ChatMessage] = []
    reasoning: str | None = None
    for i, item in enumerate(value):
        where = f"{param}.{i}"
        if not isinstance(item, dict):
            raise bad_request("An input item must be an object.", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _INPUT_ROLES:
                raise bad_request(f"`role` must be one of {', '.join(_INPUT_ROLES)}.",
                                  param=f"{where}.role")
            text = _parts_text(item.get("content"), role, f"{where}.content")
            message = ChatMessage(role=role, content=text)
            if role == "assistant":
                message.reasoning_content = reasoning
            reasoning = None  # reasoning belongs to the assistant turn right after it
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and reasoning is None:
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call],
                                            reasoning_content=reasoning))
                reasoning = None
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, "tool",
                                                                       f"{where}.output")
            messages.append(ChatMessage(role="tool", content=text,
                                        tool_call_id=_string(item, "call_id", where)))
            reasoning = None
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where) or None
        else:
            raise bad_request(f"Input items of type {kind!r} are not supported (message, "
                              "function_call, function_call_output and reasoning are).",
                              param=f"{where}.type")
    if not messages:
        raise bad_request("`input` holds no message.", param=param)
    return messages


def check_call_outputs(value: Any, history: list[dict[str, Any]], param: str = "input") -> None:
    """OpenAI's rule: a `function_call_output` answers a `function_call` made before it, in this
    input or in the conversation it continues; an output whose call is nowhere is a client bug
    (a mistyped or stale call_id) that the model would otherwise read as a stray tool message.
    `value` has passed `input_messages`."""
    if isinstance(value, str):
        return
    calls = {item["call_id"] for item in history if item.get("type") == "function_call"}
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "function_call":
            calls.add(item["call_id"])
        elif kind == "function_call_output" and item["call_id"] not in calls:
            raise bad_request("No tool call found for function call output with call_id "
                              f"{item['call_id']}.", param=f"{param}.{i}")


def check_unique_item_ids(value: Any, history: list[dict[str, Any]], param: str = "input"
                          ) -> None:
    """OpenAI's rule: an item id names one item of the conversation. A client that sends back
    the items `previous_response_id` already holds (an SDK's `response.output` fed in again)
    would give the model the same call twice and make `input_items`' `after` cursor
    ambiguous. `value` has passed `input_messages`."""
    if isinstance(value, str):
        return
    seen = {item["id"] for item in history if isinstance(item.get("id"), str)}
    for i, item in enumerate(value):
        given = item.get("id")
        if not isinstance(given, str) or not given:
            continue  # the server names it
        if given in seen:
            raise bad_request(f"Duplicate item found with id {given}.", param=f"{param}.{i}")
        seen.add(given)


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools -> chat tools (`{"type": "function", "function": {...}}`)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"Tools of type {kind!r} are not supported; only 'function' tools.",
                              param=f"tools.{i}.type")
        # The SDK sends null for the fields it has no value for.
        given = {k: v for k, v in tool.items() if v is not None and k not in _IGNORED_TOOL_KEYS}
        unknown = sorted(set(given) - _FUNCTION_TOOL_KEYS)
        if unknown:
            raise bad_request(f"Unknown field(s) in a function tool: {', '.join(unknown)}.",
                              param=f"tools.{i}")
        out.append({"type": "function",
                    "function": {k: v for k, v in given.items() if k != "type"}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str) and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("`tool_choice` must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'name': ...}.", param="tool_choice")


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` -> the chat route's `response_format`."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("`text.format` must be an object.", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise bad_request("`text.format.name` is required with type json_schema.",
                              param="text.format.name")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request("`text.format.type` must be 'text', 'json_object' or 'json_schema'.",
                      param="text.format.type")


# Chat parameter -> the Responses parameter it came from, for error messages. (A chat message's
# index is not an input item's: instructions, earlier turns and merged calls shift it, so
# `messages.3.content` names the whole `input`.)
_PARAM_PREFIXES = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                   ("response_format.json_schema", "text.format"),
                   ("response_format", "text.format"))


def responses_error(exc: APIError) -> APIError:
    """A chat-route error renamed to the Responses parameters."""
    param = exc.param
    if param is None:
        return exc
    for chat, ours in _PARAM_PREFIXES:
        if param == chat or param.startswith(chat + "."):
            param = ours if chat == "messages" else ours + param[len(chat):]
            break
    if param.startswith("tools.") and ".function" in param:
        param = param.replace(".function", "", 1)
    if param == exc.param:
        return exc
    message = exc.message.replace(f"`{exc.param}`", f"`{param}`")
    if exc.code == "context_length_exceeded":  # these name the prompt in words
        message = message.replace("messages", "input").replace(
            "in the completion", "in max_output_tokens").replace("or completion",
                                                                 "or max_output_tokens")
    return APIError(exc.status, message, type=exc.type, param=param, code=exc.code,
                    headers=exc.headers)


# ---- output items ---------------------------------------------------------------------------------

def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                     "reasoning": "rs"}


def input_item_resources(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's (validated) `input` as the items OpenAI lists back: each with an `id` and
    a `type`, message text as content parts. Copies; the request is left as it was."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    resources = []
    for item in value:
        item = {"type": "message", **item}
        if not isinstance(item.get("id"), str) or not item["id"]:
            item["id"] = item_id(_ITEM_ID_PREFIXES[item["type"]])
        if item["type"] == "message":
            item.setdefault("status", "completed")
            if isinstance(item.get("content"), str):
                text = item["content"]
                item["content"] = [text_part(text) if item.get("role") == "assistant"
                                   else {"type": "input_text", "text": text}]
        resources.append(item)
    return resources


def reasoning_item(text: str, status: str = "completed", id_: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": id_ or item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "status": status}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(text: str | None, status: str = "completed", id_: str | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    content = [] if text is None else [text_part(text, logprobs)]
    return {"type": "message", "id": id_ or item_id("msg"), "role": "assistant",
            "status": status, "content": content}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       id_: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": id_ or item_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def response_logprobs(chat_entries: Any) -> list[dict[str, Any]]:
    """The chat route's logprob entries as output_text logprobs."""
    if chat_entries is None:
        return []
    return [{"token": e.token, "bytes": e.bytes or [], "logprob": e.logprob,
             "top_logprobs": [{"token": t.token, "bytes": t.bytes or [], "logprob": t.logprob}
                              for t in e.top_logprobs]}
            for e in chat_entries.content]
