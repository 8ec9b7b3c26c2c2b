"""Formats that put hermes-style JSON call objects (`{"name": ..., "arguments": {...}}`)
between tags of their own, content around them, as hermes's (`hermes.TaggedJsonToolParser`;
a body is one object, several after each other, or a JSON array of them):

- `longcat` (Meituan LongCat-Flash): `<longcat_tool_call>{...}</longcat_tool_call>` per call;
- `jamba` (AI21 Jamba 1.5+): `<tool_calls>[{...}, {...}]</tool_calls>`;
- `minimax` (MiniMax-M1): `<tool_calls>` then one object per line, then `</tool_calls>`;
- `hunyuan_a13b` (Tencent Hunyuan-A13B): Jamba's, inside its `<answer>` (which the
  `hunyuan_a13b` reasoning parser takes off).
"""

from __future__ import annotations

from ksana_llm.server.tool_parsers.hermes import TaggedJsonToolParser


class LongcatToolParser(TaggedJsonToolParser):
    name = "longcat"
    start = "<longcat_tool_call>"
    end = "</longcat_tool_call>"


class JambaToolParser(TaggedJsonToolParser):
    name = "jamba"
    start = "<tool_calls>"
    end = "</tool_calls>"


class MiniMaxToolParser(JambaToolParser):
    """MiniMax-M1's block: the tags Jamba's has, one call object per line in it."""

    name = "minimax"


class HunyuanA13BToolParser(JambaToolParser):
    name = "hunyuan_a13b"
