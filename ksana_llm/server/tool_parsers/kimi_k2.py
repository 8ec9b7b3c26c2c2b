"""Kimi-K2's tool calls (vLLM's `kimi_k2`):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The text before `<|tool_call_argument_begin|>` is the call's id, `functions.NAME:INDEX`, which
Kimi's chat template writes back into the conversation: it is the id the client gets (and calls
forced by tool_choice get ids of that shape). The
markers are special tokens, so the server decodes the output with special tokens for it.
"""

from __future__ import annotations

import re

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream, named_arguments

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
CALL_END = "<|tool_call_end|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_CALL_ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_.\-]{1,64}):\d+")


def parse_kimi_body(body: str) -> BodyScan:
    arguments_at = body.find(ARGUMENT_BEGIN)
    if arguments_at < 0:
        return BodyScan()  # the id may still grow
    call_id = body[:arguments_at].strip()
    match = _CALL_ID.fullmatch(call_id)
    if match is None:
        return BodyScan()
    scan = named_arguments(match.group(1), body, arguments_at + len(ARGUMENT_BEGIN))
    scan.call_id = call_id
    return scan


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    reads_special_tokens = True

    def stream(self) -> ToolCallStream:
        return TaggedToolStream(CALL_BEGIN, CALL_END, parse_kimi_body,
                                ignored=(SECTION_BEGIN, SECTION_END))

    @staticmethod
    def new_call_id(name: str, index: int) -> str:
        """The id a call gets where the markup gives none (tool_choice "required" or named,
        whose output is JSON): the shape Kimi's markup writes."""
        return f"functions.{name}:{index}"
