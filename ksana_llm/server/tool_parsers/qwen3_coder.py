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
arrives (`xml_calls`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ksana_llm.server.tool_parsers.xml_calls import (
    ParameterMarkup,
    declared_types,
    ParameterTagToolParser,
    read_literal,
    unquoted,
)


def coder_markup(call_end: str) -> ParameterMarkup:
    """Qwen3-Coder's function and parameter tags, in calls that `call_end` ends."""
    return ParameterMarkup(function="<function=", parameter="<parameter=",
                           parameter_end="</parameter>", function_end="</function>",
                           call_end=call_end)


def typed_value(text: str, schema: Any) -> Any:
    """`text` as the JSON value its parameter's schema declares; the text itself otherwise."""
    if text.strip().lower() == "null":
        return None
    for kind in declared_types(schema):
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
        return int(text) if re.fullmatch(r"[+-]?\d+", text) else number
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower())
    if kind in ("object", "array"):
        read, value = read_literal(text)
        return value if read and isinstance(value, dict if kind == "object" else list) else None
    return None


def _bare(value: str) -> str:
    """The parameter's text without the newlines that frame it in the markup."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def read_parameter(header: str, text: str, properties: Mapping[str, Any]) -> tuple[str, Any]:
    key = unquoted(header)  # (MiniMax-M2 quotes the name)
    return key, typed_value(_bare(text), properties.get(key))


class Qwen3CoderToolParser(ParameterTagToolParser):
    name = "qwen3_coder"
    call_start = "<tool_call>"
    markup = coder_markup("</tool_call>")
    read_value = staticmethod(read_parameter)


class Qwen3XmlToolParser(Qwen3CoderToolParser):
    """vLLM's `qwen3_xml`: the same Qwen3-Coder format, read by another of its parsers."""

    name = "qwen3_xml"
