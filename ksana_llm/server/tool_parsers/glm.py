"""GLM-4.5 / GLM-4.6's tool calls (vLLM's `glm45`) and GLM-4.7's (`glm47`), as their chat
templates write them:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7 writes the same tags without the newlines (`<tool_call>get_weather<arg_key>...`); both
parsers read both. A value is the text between its tags, as written for a parameter the
request's tool declares a string; any other value (the templates write non-strings as JSON) is
read as JSON, or as a Python literal, and stays text when it is neither -- also without the
request's tools, as vLLM reads them.

A call's name goes out once the line (or the first `<arg_key>`) ends it, each parameter once its
`</arg_value>` arrives (`xml_calls`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ksana_llm.server.tool_parsers.xml_calls import (
    ParameterMarkup,
    ParameterTagToolParser,
    declared_types,
    read_literal,
)

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ARG_KEY = "<arg_key>"
MARKUP = ParameterMarkup(function="", parameter=ARG_KEY, parameter_end="</arg_value>",
                         function_end="", call_end=TOOL_CALL_END,
                         name_ends=("\n", "\\n", ARG_KEY, TOOL_CALL_END), header_end="</arg_key>",
                         value_open="<arg_value>")


def read_parameter(header: str, text: str, properties: Mapping[str, Any]) -> tuple[str, Any]:
    key = header.strip()
    if "string" in declared_types(properties.get(key)):
        return key, text
    read, value = read_literal(text.strip())
    return key, value if read else text


class Glm45ToolParser(ParameterTagToolParser):
    name = "glm45"
    call_start = TOOL_CALL
    markup = MARKUP
    read_value = staticmethod(read_parameter)


class Glm47ToolParser(Glm45ToolParser):
    """GLM-4.7's calls: the same tags, without newlines between them."""

    name = "glm47"
