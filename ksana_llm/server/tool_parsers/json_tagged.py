"""Formats that put hermes-style JSON call objects (`{"name": ..., "arguments": {...}}`)
between tags of their own, content around them, as hermes's (`hermes.TaggedJsonToolParser`;
a body is one object, several after each other, or a JSON array of them):

- `longcat` (Meituan LongCat-Flash): `<longcat_tool_call>{...}</longcat_tool_call>` per call;
- `jamba` (AI21 Jamba 1.5+): `<tool_calls>[{...}, {...}]</tool_calls>`;
- `minimax` (MiniMax-M1): `<tool_calls>` then one object per line, then `</tool_calls>`;
- `hunyuan_a13b` (Tencent Hunyuan-A13B): Jamba's, inside its `<answer>` (which the
  `hunyuan_a13b` reasoning parser takes off);
- `ernie45` (Baidu ERNIE-4.5): hermes's `<tool_call>{...}</tool_call>`; an answer without calls
  may come inside `<response>...</response>`, which are no content (`Ernie45ToolParser`).
"""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import ToolCallStream
from ksana_llm.server.tool_parsers.hermes import HermesToolParser, TaggedJsonToolParser, parse_json_body
from ksana_llm.server.tool_parsers.tagged import TaggedToolStream

ERNIE_RESPONSE_TAGS = ("<response>", "</response>")


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


class Ernie45ToolParser(HermesToolParser):
    """ERNIE-4.5's calls are hermes's. Its thinking model writes `</think>`, then either calls
    or an answer in `<response>` tags: the `ernie45` reasoning parser takes both off (with the
    newlines just inside the tags) before the calls are read; without it, the tags still vanish
    here, as vLLM's streamed parsing drops them (the newlines then stay content)."""

    name = "ernie45"

    def stream(self) -> ToolCallStream:
        return TaggedToolStream(self.start, self.end, parse_json_body, ignored=ERNIE_RESPONSE_TAGS)
