"""Phi-4-mini's tool calls (vLLM's `phi4_mini_json`): the answer is `functools` followed by a
JSON array of `{"name": "f", "arguments": {...}}` objects; text after the array is content, and
an answer that does not open with `functools[` is plain content."""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.json_calls import JsonCallSequenceStream


class Phi4MiniJsonToolParser(ToolParser):
    name = "phi4_mini_json"

    def stream(self) -> ToolCallStream:
        return JsonCallSequenceStream(open="[", separator=",", close="]", lead=("functools",),
                                      lead_is_text=True)
