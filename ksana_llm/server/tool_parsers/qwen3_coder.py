"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder`), as its chat template asks for:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are bare text (the newline after the opening tag and the one before the closing
tag are markup), so their JSON type comes from the request's tool: a parameter the schema
declares an integer, number, boolean, object or array is read as one (text that does not read
as its type stays a string, as written), the text `null` is null, and everything else --
strings, parameters without a declared type, requests without that tool -- is a string.

A call's name goes out once `<function=NAME>` is complete, each parameter once its closing tag
arrives (the arguments object grows `{"city": "Paris"`, then `, "days": 3`, then `}` at
`</function>`), so a long parameter costs linear time however finely it streams.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.json_scan import skip_ws
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream

FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
_LONGEST_TAG = max(len(FUNCTION_END), len(PARAMETER), len(PARAMETER_END))
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

Schemas = Mapping[str, Mapping[str, Any]]  # function name -> its parameters' JSON schemas


def parameter_schemas(tools: list[dict[str, Any]] | None) -> Schemas:
    """Each offered function's `parameters.properties`."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties")
        if isinstance(function.get("name"), str) and isinstance(properties, Mapping):
            out[function["name"]] = properties
    return out


def _declared_types(schema: Any) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    options = schema.get("anyOf") or schema.get("oneOf") or []
    return [k for option in options if isinstance(option, Mapping)
            for k in _declared_types(option)]


def typed_value(text: str, schema: Any) -> Any:
    """`text` as the JSON value its parameter's schema declares; the text itself otherwise."""
    if text.strip().lower() == "null":
        return None
    for kind in _declared_types(schema):
        value = _as_type(text.strip(), kind)
        if value is not None:
            return value
    return text


def _as_type(text: str, kind: str) -> Any:
    """`text` read as JSON type `kind`, or None if it does not read as one."""
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            return None
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return None
        if not math.isfinite(number):
            return None
        return int(number) if number.is_integer() and re.fullmatch(r"[+-]?\d+", text) else number
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower())
    if kind in ("object", "array"):
        for read in (json.loads, ast.literal_eval):
            try:
                value = read(text)
            except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
                continue
            if isinstance(value, dict if kind == "object" else (list, tuple)):
                try:  # a Python literal (single quotes, True) must have a JSON form
                    json.dumps(value, allow_nan=False)
                except (TypeError, ValueError):
                    return None
                return value
        return None
    return None


def _bare(value: str) -> str:
    """The parameter's text without the newlines that frame it in the markup."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class _CallBody:
    """The body parser of one stream. A call's body only grows until the next call starts
    (`restart`), so it resumes where it stopped: the parameters read so far are kept as the
    arguments text they gave."""

    def __init__(self, schemas: Schemas) -> None:
        self._schemas = schemas
        self.restart()

    def restart(self) -> None:
        self._name: str | None = None
        self._properties: Mapping[str, Any] = {}
        self._pos = 0  # the body before it is read
        self._key: str | None = None  # the open parameter's name
        self._value_start = 0  # where its value starts
        self._search_from = 0  # where to look on for the end of its value
        self._arguments = "{"
        self._done = False

    def __call__(self, body: str) -> BodyScan:
        if self._name is None and not self._read_name(body):
            return BodyScan()
        while not self._done and self._read_parameter(body):
            pass
        return BodyScan(self._name, self._arguments + ("}" if self._done else ""))

    def _read_name(self, body: str) -> bool:
        start = skip_ws(body, 0)
        if not body.startswith(FUNCTION, start):
            return False  # still coming, or not a call (the region is then content)
        close = body.find(">", start)
        if close < 0:
            return False
        name = body[start + len(FUNCTION):close].strip()
        if not _FUNCTION_NAME.fullmatch(name):
            return False
        self._name = name
        self._properties = self._schemas.get(name, {})
        self._pos = close + 1
        return True

    def _read_parameter(self, body: str) -> bool:
        """Read the next parameter (or the function's end) if it is complete; False if not."""
        if self._key is None:
            opening = body.find(PARAMETER, self._pos)
            closing = body.find(FUNCTION_END, self._pos)
            if closing >= 0 and (opening < 0 or closing < opening):
                self._done = True
                return False
            if opening < 0:
                return False
            key_end = body.find(">", opening)
            if key_end < 0:
                return False
            self._key = body[opening + len(PARAMETER):key_end].strip()
            self._value_start = self._search_from = key_end + 1
        # The value ends at its closing tag, or where a model that left the tag out went on.
        ends = [i for i in (body.find(tag, self._search_from)
                            for tag in (PARAMETER_END, PARAMETER, FUNCTION_END)) if i >= 0]
        if not ends:
            self._search_from = max(self._value_start, len(body) - _LONGEST_TAG)
            return False
        end = min(ends)
        value = typed_value(_bare(body[self._value_start:end]), self._properties.get(self._key))
        pair = f"{json.dumps(self._key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._arguments += pair if self._arguments == "{" else ", " + pair
        self._pos = end + (len(PARAMETER_END) if body.startswith(PARAMETER_END, end) else 0)
        self._key = None
        return True


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def stream(self) -> ToolCallStream:
        return self.stream_for(None)

    def stream_for(self, tools: list[dict[str, Any]] | None) -> ToolCallStream:
        body = _CallBody(parameter_schemas(tools))
        return TaggedToolStream("<tool_call>", "</tool_call>", body, on_new_body=body.restart)
