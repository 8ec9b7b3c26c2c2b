"""GPT-OSS's tool calls (`--tool-call-parser openai`, vLLM's name): harmony messages to
`functions.NAME`, whose body is the call's JSON arguments (see `tool_parsers.harmony`). The
`final` and `commentary` messages' bodies (and plain text) are content; the `analysis` channel
(the chain of thought, which `--reasoning-parser openai_gptoss` reads) and messages to other
recipients (built-in tools) are not, nor any header or special token."""

from __future__ import annotations

from ksana_llm.server.tool_parsers.harmony import HarmonyEvent, HarmonyMessages
from ksana_llm.server.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolCallStream, ToolParser


class HarmonyCallStream(ToolCallStream):
    def __init__(self) -> None:
        self._messages = HarmonyMessages()
        self._call_index: dict[int, int] = {}  # message number -> tool-call index

    def feed(self, text: str) -> ParsedDelta:
        return self._route(self._messages.feed(text))

    def finish(self) -> ParsedDelta:
        return self._route(self._messages.finish())

    def _route(self, events: list[HarmonyEvent]) -> ParsedDelta:
        out = ParsedDelta()
        for event in events:
            message = event.message
            function = message.function
            if function is None:
                if message.recipient is None and message.channel != "analysis":
                    out.content += event.text
            elif event.kind == "open":  # the name is whole once the header is
                index = self._call_index[message.number] = len(self._call_index)
                out.tool_calls.append(ToolCallDelta(index, function))
            elif event.kind == "text":
                out.tool_calls.append(ToolCallDelta(self._call_index[message.number],
                                                    arguments=event.text))
        return out


class HarmonyToolParser(ToolParser):
    name = "openai"
    reads_special_tokens = True

    def stream(self) -> ToolCallStream:
        return HarmonyCallStream()
