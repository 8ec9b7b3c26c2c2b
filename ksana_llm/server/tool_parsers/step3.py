"""StepFun Step-3's tool calls (vLLM's `step3`):

    <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="get_weather">
    <steptml:parameter name="city">Paris</steptml:parameter>
    <steptml:parameter name="days">3</steptml:parameter>
    </steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>

(`｜` is the full-width bar, U+FF5C.) Each `<｜tool_call_begin｜>` region is one call; the
block's tags vanish. Parameter values are bare text, stripped, and typed by the request's tool
schema as Qwen3-Coder's are (`qwen3_coder.typed_value`). The markers are special tokens, so the
server decodes the output with them, as vLLM does for this parser. A region that does not hold
`function<｜tool_sep｜><steptml:invoke name=...>` is content, tags included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ksana_llm.server.tool_parsers.qwen3_coder import typed_value
from ksana_llm.server.tool_parsers.xml_calls import ParameterMarkup, ParameterTagToolParser, unquoted

CALLS_BEGIN = "<｜tool_calls_begin｜>"
CALLS_END = "<｜tool_calls_end｜>"
CALL_BEGIN = "<｜tool_call_begin｜>"
CALL_END = "<｜tool_call_end｜>"
SEP = "<｜tool_sep｜>"
MARKUP = ParameterMarkup(function=f"function{SEP}<steptml:invoke name=",
                         parameter="<steptml:parameter name=",
                         parameter_end="</steptml:parameter>", function_end="</steptml:invoke>",
                         call_end=CALL_END)


def read_parameter(header: str, text: str, properties: Mapping[str, Any]) -> tuple[str, Any]:
    """`"KEY"` and the value's text, without the whitespace around it (the template's layout)."""
    key = unquoted(header)
    return key, typed_value(text.strip(), properties.get(key))


class Step3ToolParser(ParameterTagToolParser):
    name = "step3"
    reads_special_tokens = True
    call_start = CALL_BEGIN
    markup = MARKUP
    read_value = staticmethod(read_parameter)
    ignored = (CALLS_BEGIN, CALLS_END)
