"""Hermes-style calls, as Qwen2.5 / Qwen3 / NousHermes templates ask for:
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, any number, content around them."""

from __future__ import annotations

from typing import ClassVar

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.json_scan import scan_call_object, skip_ws
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream


def parse_json_body(body: str, pos: int = 0) -> BodyScan:
    """One call object; several in one body (after each other, comma-separated, or as a JSON
    array) are several calls: `next_at` says where the next one starts. `pos`: where the JSON
    starts (after a format's own text at the body's start)."""
    start = skip_ws(body, pos)
    if start < len(body) and body[start] == "[":
        start = skip_ws(body, start + 1)
    if start >= len(body) or body[start] != "{":
        return BodyScan()
    call = scan_call_object(body, start)
    next_at = None
    final = False
    if call.end is not None and call.name is not None:
        after = skip_ws(body, call.end)
        if after < len(body) and body[after] == ",":
            after = skip_ws(body, after + 1)
        if after < len(body) and body[after] == "{":
            next_at = after
        # Other text after the object (`]`, prose): no call can follow in this body.
        final = after < len(body) and body[after] not in ",{"
    return BodyScan(call.name, call.arguments(body) if call.name is not None else "",
                    open_at=call.open_at,
                    open_is_arguments=call.open_at is not None and call.open_at == call.args_start,
                    next_at=next_at, final=final)


class TaggedJsonToolParser(ToolParser):
    """Calls as JSON objects between `start` and `end` tags (`parse_json_body`), content
    around them; other formats of this shape: `json_tagged`."""

    start: ClassVar[str]
    end: ClassVar[str]

    def stream(self) -> ToolCallStream:
        return TaggedToolStream(self.start, self.end, parse_json_body)


class HermesToolParser(TaggedJsonToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"


class Qwen3ToolParser(HermesToolParser):
    """Qwen3's template asks for exactly the hermes format."""

    name = "qwen3"
