"""InternLM2 / 2.5's tool calls (vLLM's `internlm`): `<|action_start|><|plugin|>` then one
`{"name": "f", "parameters": {...}}` object, then `<|action_end|>`, with content before it. The
markers are special tokens, so the server decodes the output with special tokens for it; its
code-interpreter actions (`<|action_start|><|interpreter|>`) are no function calls and stay
content."""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.hermes import parse_json_body
from ksana_llm.server.tool_parsers.tagged import TaggedToolStream

PLUGIN_START = "<|action_start|><|plugin|>"
ACTION_END = "<|action_end|>"


class InternLMToolParser(ToolParser):
    name = "internlm"
    reads_special_tokens = True

    def stream(self) -> ToolCallStream:
        return TaggedToolStream(PLUGIN_START, ACTION_END, parse_json_body)
