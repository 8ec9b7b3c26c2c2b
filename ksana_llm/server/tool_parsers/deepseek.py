"""DeepSeek's tool-call formats.

V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`. V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
"""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.json_scan import skip_ws
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream, named_arguments

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"


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
