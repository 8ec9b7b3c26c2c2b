"""Hermes-style calls, as Qwen2.5 / Qwen3 / NousHermes templates ask for:
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, any number, content around them."""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.json_scan import scan_call_object, skip_ws
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream


def parse_json_body(body: str) -> BodyScan:
    start = skip_ws(body, 0)
    if start >= len(body) or body[start] != "{":
        return BodyScan()
    call = scan_call_object(body, start)
    return BodyScan(call.name, call.arguments(body) if call.name is not None else "",
                    open_at=call.open_arguments)


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolCallStream:
        return TaggedToolStream("<tool_call>", "</tool_call>", parse_json_body)


class Qwen3ToolParser(HermesToolParser):
    """Qwen3's template asks for exactly the hermes format."""

    name = "qwen3"
