"""Salesforce xLAM's tool calls (vLLM's `xlam`): a JSON array of `{"name": ..., "arguments":
{...}}` objects, written

- as the whole output (text after the array is content; an array of anything else is content);
- or after content, in a fenced block (```` ```json [...] ``` ````, the language tag optional),
  between `<tool_call>` and `</tool_call>`, or after `[TOOL_CALLS]` (to the end of the output).

The first visible character decides: `[` reads the output as the array (`JsonCallSequenceStream`,
`[TOOL_CALLS]` before it dropped), anything else as content with tagged regions
(`TaggedToolStream`; a body may hold one object or the array, as hermes's may). A fenced block
that holds no calls (code in an answer) is content, fences included, once it closes. vLLM also
reads an array after `</think>`; here the reasoning parser takes the thinking block off first.
"""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import ParsedDelta, ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.hermes import parse_json_body
from ksana_llm.server.tool_parsers.json_calls import JsonCallSequenceStream
from ksana_llm.server.tool_parsers.json_scan import skip_ws
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_CALLS = "[TOOL_CALLS]"
FENCE = "```"
FENCE_LANGUAGE = "json"


def parse_xlam_body(body: str) -> BodyScan:
    """hermes's body, after a fence's `json` tag where one is written."""
    start = skip_ws(body, 0)
    if body.startswith(FENCE_LANGUAGE, start):
        start += len(FENCE_LANGUAGE)
    return parse_json_body(body, start)


class XlamStream(ToolCallStream):
    """Leading whitespace waits for the first visible character, which picks the stream that
    reads the output (both are then given everything, that whitespace first)."""

    def __init__(self) -> None:
        self._inner: ToolCallStream | None = None
        self._head = ""  # the whitespace before the first visible character

    def feed(self, text: str) -> ParsedDelta:
        if self._inner is None:
            self._head += text
            first = skip_ws(self._head, 0)
            if first == len(self._head):
                return ParsedDelta()
            self._inner = _array_stream() if self._head[first] == "[" else _tagged_stream()
            text, self._head = self._head, ""
        return self._inner.feed(text)

    def finish(self) -> ParsedDelta:
        if self._inner is not None:
            return self._inner.finish()
        self._inner = _tagged_stream()  # (whitespace only: content, as any stream sends it)
        out = self._inner.feed(self._head)
        out.extend(self._inner.finish())
        return out


def _array_stream() -> ToolCallStream:
    return JsonCallSequenceStream(open="[", separator=",", close="]", lead=(TOOL_CALLS,))


def _tagged_stream() -> ToolCallStream:
    return TaggedToolStream(TOOL_CALL, TOOL_CALL_END, parse_xlam_body,
                            more=((FENCE, FENCE), (TOOL_CALLS, None)))


class XlamToolParser(ToolParser):
    name = "xlam"

    def stream(self) -> ToolCallStream:
        return XlamStream()
