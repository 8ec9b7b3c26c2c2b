"""Tool-call parsers (`--tool-call-parser NAME`): model text -> content + OpenAI tool calls,
streamed or not. See `base.py` for the contract every parser keeps."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ksana_llm.server.tool_parsers.base import (
    ParsedDelta,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    WholeTextToolParser,
    coalesce,
    collect,
)
from ksana_llm.server.tool_parsers.deepseek import (DeepSeekV3ToolParser, DeepSeekV31ToolParser,
                                                   DeepSeekV32ToolParser)
from ksana_llm.server.tool_parsers.glm import Glm45ToolParser, Glm47ToolParser
from ksana_llm.server.tool_parsers.granite import GraniteToolParser
from ksana_llm.server.tool_parsers.harmony_calls import HarmonyToolParser
from ksana_llm.server.tool_parsers.hermes import HermesToolParser, Qwen3ToolParser
from ksana_llm.server.tool_parsers.internlm import InternLMToolParser
from ksana_llm.server.tool_parsers.json_calls import JsonCallSequenceStream
from ksana_llm.server.tool_parsers.json_tagged import (Ernie45ToolParser, HunyuanA13BToolParser,
                                                     JambaToolParser, LongcatToolParser,
                                                     MiniMaxToolParser)
from ksana_llm.server.tool_parsers.kimi_k2 import KimiK2ToolParser
from ksana_llm.server.tool_parsers.llama3_json import Llama3JsonToolParser, Llama4JsonToolParser
from ksana_llm.server.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from ksana_llm.server.tool_parsers.mistral import MistralToolParser
from ksana_llm.server.tool_parsers.olmo3 import Olmo3ToolParser
from ksana_llm.server.tool_parsers.phi4_mini import Phi4MiniJsonToolParser
from ksana_llm.server.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from ksana_llm.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser, Qwen3XmlToolParser
from ksana_llm.server.tool_parsers.seed_oss import SeedOssToolParser
from ksana_llm.server.tool_parsers.step3 import Step3ToolParser
from ksana_llm.server.tool_parsers.xlam import XlamToolParser

TOOL_PARSERS: MappingProxyType[str, type[ToolParser]] = MappingProxyType({
    cls.name: cls for cls in (HermesToolParser, Qwen3ToolParser, Llama3JsonToolParser,
                              DeepSeekV3ToolParser, DeepSeekV31ToolParser, HarmonyToolParser,
                              MistralToolParser, PythonicToolParser, Llama4PythonicToolParser,
                              Qwen3CoderToolParser, KimiK2ToolParser, InternLMToolParser,
                              GraniteToolParser, DeepSeekV32ToolParser, Llama4JsonToolParser,
                              Qwen3XmlToolParser, Glm45ToolParser, Glm47ToolParser,
                              SeedOssToolParser, LongcatToolParser, JambaToolParser,
                              MiniMaxToolParser, MiniMaxM2ToolParser, Phi4MiniJsonToolParser,
                              HunyuanA13BToolParser, Ernie45ToolParser, Olmo3ToolParser,
                              XlamToolParser, Step3ToolParser)})


def get_tool_parser(name: str, plugins: Mapping[str, type[ToolParser]] | None = None) -> ToolParser:
    """The parser registered as `name`, among the built-in ones and `plugins` (those a
    `--tool-parser-plugin` file defines); ValueError listing the known names otherwise."""
    known = {**TOOL_PARSERS, **(plugins or {})}
    cls = known.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(known))}")
    return cls()


__all__ = ["TOOL_PARSERS", "JsonCallSequenceStream", "ParsedDelta", "ParsedOutput", "ToolCall",
           "ToolCallDelta", "ToolCallStream", "ToolParser", "WholeTextToolParser", "coalesce",
           "collect", "get_tool_parser"]
