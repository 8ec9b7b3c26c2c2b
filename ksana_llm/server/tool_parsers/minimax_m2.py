"""MiniMax-M2's tool calls (vLLM's `minimax_m2`), as its chat template asks for:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Each `<invoke>` in a block is one call (an `<invoke>` outside one is text, as in vLLM);
parameter values are bare text typed by the request's tool schema, as Qwen3-Coder's are
(`qwen3_coder.read_parameter`).
"""

from __future__ import annotations

from ksana_llm.server.tool_parsers.qwen3_coder import read_parameter
from ksana_llm.server.tool_parsers.xml_calls import ParameterMarkup, ParameterTagToolParser

MARKUP = ParameterMarkup(function="<invoke name=", parameter="<parameter name=",
                         parameter_end="</parameter>", function_end="</invoke>",
                         call_end="</minimax:tool_call>")


class MiniMaxM2ToolParser(ParameterTagToolParser):
    name = "minimax_m2"
    call_start = "<minimax:tool_call>"
    markup = MARKUP
    read_value = staticmethod(read_parameter)
