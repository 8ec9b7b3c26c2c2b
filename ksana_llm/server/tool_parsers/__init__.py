"""Tool-call parsers (`--tool-call-parser NAME`): model text -> content + OpenAI tool calls,
streamed or not. See `base.py` for the contract every parser keeps."""

from __future__ import annotations

from types import MappingProxyType

from ksana_llm.server.tool_parsers.base import (
    ParsedDelta,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    coalesce,
    collect,
)
from ksana_llm.server.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from ksana_llm.server.tool_parsers.hermes import HermesToolParser, Qwen3ToolParser
from ksana_llm.server.tool_parsers.json_calls import JsonCallSequenceStream
from ksana_llm.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: MappingProxyType[str, type[ToolParser]] = MappingProxyType({
    cls.name: cls for cls in (HermesToolParser, Qwen3ToolParser, Llama3JsonToolParser,
                              DeepSeekV3ToolParser, DeepSeekV31ToolParser)})


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError listing the known names otherwise."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return cls()


__all__ = ["TOOL_PARSERS", "JsonCallSequenceStream", "ParsedDelta", "ParsedOutput", "ToolCall",
           "ToolCallDelta", "ToolCallStream", "ToolParser", "coalesce", "collect",
           "get_tool_parser"]
