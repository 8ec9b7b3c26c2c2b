"""IBM Granite 3.x's tool calls (vLLM's `granite`): the answer is a JSON array of
`{"name": "f", "arguments": {...}}` objects after `<|tool_call|>` (Granite 3.0) or `<tool_call>`
(3.1 and later); text after the array is content. An answer that does not open with the array
(after the tag) is plain content."""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.json_calls import JsonCallSequenceStream

TAGS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(ToolParser):
    name = "granite"

    def stream(self) -> ToolCallStream:
        return JsonCallSequenceStream(open="[", separator=",", close="]", lead=TAGS)
