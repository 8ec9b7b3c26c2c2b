"""`tools` and `tool_choice` of a chat request -> what the template sees, how the output is
constrained, and how it is read back as tool calls.

- "none": no tool calls are extracted (the tools still go to the template).
- "auto": the model decides; the `--tool-call-parser` reads its calls out of free text
  (needs `--enable-auto-tool-choice`, as in vLLM).
- "required": the output is constrained to a JSON array of `{"name", "parameters"}` objects,
  one of the tools each (vLLM's schema), with at least one call.
- named `{"type": "function", "function": {"name": ...}}`: the output is constrained to that
  function's parameters, and is its one call.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from ksana_llm.server.errors import bad_request
from ksana_llm.server.structured_params import StructuredRequest
from ksana_llm.server.tool_parsers import (
    JsonCallSequenceStream,
    ParsedDelta,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None  # for the chat template
    function: str | None = None  # the named function
    constraint: StructuredRequest | None = None  # required / named: the output's JSON schema
    parser: ToolParser | None = None  # auto: the server's parser
    single_call: bool = False  # auto with parallel_tool_calls false: calls after the first dropped

    def stream(self) -> ToolCallStream | None:
        """A fresh per-choice extractor, or None when tool calls are not extracted."""
        if self.mode == "auto" and self.parser is not None:
            stream = self.parser.stream_for(self.tools)
            return FirstCallOnly(stream) if self.single_call else stream
        if self.mode == "required":
            return JsonCallSequenceStream(open="[", separator=",", close="]", calls_only=True)
        if self.mode == "named" and self.function is not None:
            return NamedCallStream(self.function)
        return None


class FirstCallOnly(ToolCallStream):
    """parallel_tool_calls false with "auto": OpenAI returns at most one call, and a free-running
    model may write several; the later ones (and only they) are dropped, streamed or not."""

    def __init__(self, inner: ToolCallStream) -> None:
        self._inner = inner

    @staticmethod
    def _first(delta: ParsedDelta) -> ParsedDelta:
        delta.tool_calls = [call for call in delta.tool_calls if call.index == 0]
        return delta

    def feed(self, text: str) -> ParsedDelta:
        return self._first(self._inner.feed(text))

    def finish(self) -> ParsedDelta:
        return self._first(self._inner.finish())


class NamedCallStream(ToolCallStream):
    """The whole output is the arguments of one call to a known function."""

    def __init__(self, name: str) -> None:
        self._name: str | None = name

    def _delta(self, text: str) -> ParsedDelta:
        name, self._name = self._name, None
        if name is None and not text:
            return ParsedDelta()
        return ParsedDelta(tool_calls=[ToolCallDelta(0, name, text)])

    def feed(self, text: str) -> ParsedDelta:
        return self._delta(text)

    def finish(self) -> ParsedDelta:
        return self._delta("")


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise bad_request("`tools` must be a non-empty list.", param="tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"At most {MAX_TOOLS} tools are allowed.", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise bad_request("A tool must be {'type': 'function', 'function': {...}}.", param=param)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request("`function` must be an object.", param=f"{param}.function")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise bad_request(f"Unknown field(s) in a function: {', '.join(sorted(unknown))}.",
                              param=f"{param}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request("A function name must be 1-64 letters, digits, '_', '.' or '-'.",
                              param=f"{param}.function.name")
        if name in names:
            raise bad_request(f"Two tools are named {name!r}.", param=f"{param}.function.name")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request("`description` must be a string.", param=f"{param}.function.description")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad_request("`parameters` must be a JSON schema object.",
                              param=f"{param}.function.parameters")
        kind = (fn.get("parameters") or {}).get("type", "object")
        if kind != "object":
            # OpenAI's rule: a call's arguments are a JSON object (clients read them as one).
            raise bad_request(f"`parameters` must describe an object (type 'object'), got type "
                              f"{kind!r}.", param=f"{param}.function.parameters")
        _check_schema(fn.get("parameters") or {}, f"{param}.function.parameters")
    return tools


def _check_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 for a schema its own JSON Schema draft calls invalid (OpenAI refuses those,
    whatever tool_choice says; the model would otherwise be shown a broken tool)."""
    if not isinstance(schema.get("$schema", ""), str):
        raise bad_request("`$schema` must be a string (a JSON Schema draft's URI).", param=param)
    problem = _schema_problem(json.dumps(schema, sort_keys=True))
    if problem is not None:
        raise bad_request(f"Invalid schema for function parameters{problem}", param=param)


@functools.lru_cache(maxsize=1024)
def _schema_problem(schema_json: str) -> str | None:
    """What is wrong with a schema (" at a.b: message"), or None. Memoised on the schema's
    text: checking takes about a millisecond, and clients send the same tools every turn."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    schema = json.loads(schema_json)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = f" at {'.'.join(map(str, exc.path))}" if exc.path else ""
        return f"{where}: {exc.message}"
    return None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _EMPTY_PARAMETERS


def _rebased_refs(node: Any, base: str) -> Any:
    """`node` with every local `$ref` ("#/...") pointing below `base` instead of the root."""
    if isinstance(node, dict):
        return {key: (base + value[1:] if key == "$ref" and isinstance(value, str)
                      and value.startswith("#") else _rebased_refs(value, base))
                for key, value in node.items()}
    if isinstance(node, list):
        return [_rebased_refs(item, base) for item in node]
    return node


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(value) for value in node.values())
    return isinstance(node, list) and any(_has_ref(item) for item in node)


def required_schema(tools: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each naming one tool and giving parameters valid for it.

    A tool's parameters that refer to their own definitions (`$ref: "#/$defs/..."`, as pydantic
    and `openai.pydantic_function_tool` write them) would point at nothing inside the array: they
    move under the root's `$defs`, their references rebased to match (vLLM lifts them too)."""
    lifted: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        parameters = _parameters(tool)
        if _has_ref(parameters):
            key = f"ksana_tool_{i}_parameters"
            lifted[key] = _rebased_refs(parameters, f"#/$defs/{key}")
            parameters = {"$ref": f"#/$defs/{key}"}
        items.append({"type": "object",
                      "properties": {"name": {"type": "string",
                                              "enum": [tool["function"]["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if lifted:
        schema["$defs"] = lifted
    return schema


def plan_tools(tools: Any, tool_choice: Any, *, parallel_tool_calls: bool | None,
               auto_enabled: bool, parser: ToolParser | None) -> ToolPlan:
    checked = _check_tools(tools) if tools is not None else None
    choice = tool_choice if tool_choice is not None else ("auto" if checked else "none")
    if choice == "none":
        return ToolPlan("none", checked)
    if checked is None:
        raise bad_request("`tool_choice` needs `tools`.", param="tool_choice")
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise bad_request('"auto" tool choice requires the server to be started with '
                              "--enable-auto-tool-choice and --tool-call-parser.",
                              param="tool_choice")
        return ToolPlan("auto", checked, parser=parser, single_call=parallel_tool_calls is False)
    if choice == "required":
        schema = required_schema(checked, parallel=parallel_tool_calls is not False)
        return ToolPlan("required", checked,
                        constraint=StructuredRequest("json_schema", json.dumps(schema), "tools"))
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("A named tool_choice must be {'type': 'function', 'function': "
                              "{'name': ...}}.", param="tool_choice")
        tool = next((t for t in checked if t["function"]["name"] == name), None)
        if tool is None:
            raise bad_request(f"tool_choice names {name!r}, which is not in `tools`.",
                              param="tool_choice")
        constraint = StructuredRequest("json_schema", json.dumps(_parameters(tool)),
                                       f"tools.{checked.index(tool)}.function.parameters")
        return ToolPlan("named", checked, function=name, constraint=constraint)
    raise bad_request("`tool_choice` must be 'none', 'auto', 'required' or a named function.",
                      param="tool_choice")
