"""DeepSeek's tool-call formats.

V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`. V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
V3.2 (DSML): `<｜DSML｜function_calls>`, then per call `<｜DSML｜invoke name="NAME">` and per
parameter `<｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>`, then
`</｜DSML｜invoke>`, and `</｜DSML｜function_calls>`. `string="true"` marks a value written as
plain text; `string="false"` one written as JSON (a number, an object), read as such (as text if
it is not JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.json_scan import skip_ws
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream, named_arguments
from ksana_llm.server.tool_parsers.xml_calls import ParameterMarkup, parameter_call_stream

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"
DSML_CALLS_BEGIN = "<｜DSML｜function_calls>"
DSML_CALLS_END = "</｜DSML｜function_calls>"
DSML_INVOKE = "<｜DSML｜invoke name="
DSML_MARKUP = ParameterMarkup(function="", parameter="<｜DSML｜parameter name=",
                              parameter_end="</｜DSML｜parameter>", function_end="</｜DSML｜invoke>")
_DSML_HEADER = re.compile(r'\s*"([^"]*)"(?:\s+string="(true|false)")?\s*')


def parse_v3_body(body: str) -> BodyScan:
    sep = body.find(SEP)
    if sep < 0:
        return BodyScan()
    newline = body.find("\n", sep + len(SEP))
    if newline < 0:
        return BodyScan()  # the name may still grow
    name = body[sep + len(SEP):newline].strip()
    if not name:
        return BodyScan()
    # The template fences the arguments (```json ... ```); models also write them unfenced, or
    # the fence and the JSON on one line: the JSON value after the fence's language tag is the
    # arguments either way (never dropped for a `{}`).
    start = skip_ws(body, newline + 1)
    rest = body[start:]
    if len(rest) < len(FENCE) and FENCE.startswith(rest):
        return BodyScan(name)  # nothing yet, or a fence still being written
    if rest.startswith(FENCE):
        start += len(FENCE)
        while start < len(body) and body[start].isalnum():  # the language tag ("json")
            start += 1
        if start == len(body):
            return BodyScan(name)  # the tag may still grow
    return named_arguments(name, body, start)


def parse_v31_body(body: str) -> BodyScan:
    sep = body.find(SEP)
    if sep < 0:
        return BodyScan()
    name = body[:sep].strip()
    if not name:
        return BodyScan()
    return named_arguments(name, body, sep + len(SEP))


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def stream(self) -> ToolCallStream:
        return TaggedToolStream(CALL_BEGIN, CALL_END, parse_v3_body, ignored=(CALLS_BEGIN, CALLS_END))


class DeepSeekV31ToolParser(ToolParser):
    name = "deepseek_v31"

    def stream(self) -> ToolCallStream:
        return TaggedToolStream(CALL_BEGIN, CALL_END, parse_v31_body, ignored=(CALLS_BEGIN, CALLS_END))


def read_dsml_parameter(header: str, text: str, properties: Mapping[str, Any]) -> tuple[str, Any]:
    """`"KEY" string="true|false"` and the value: plain text, or JSON when `string="false"`."""
    match = _DSML_HEADER.fullmatch(header)
    if match is None:
        return header.strip(), text
    key, is_string = match.groups()
    if is_string == "false":
        try:
            return key, json.loads(text)
        except ValueError:
            pass
    return key, text


class DeepSeekV32ToolParser(ToolParser):
    name = "deepseek_v32"

    def stream(self) -> ToolCallStream:
        # (Not typed by the request's tools: the markup says which values are JSON.)
        return parameter_call_stream(DSML_INVOKE, DSML_MARKUP, read_dsml_parameter, None,
                                     ignored=(DSML_CALLS_BEGIN, DSML_CALLS_END))
