"""Llama 3.x JSON tool calls: the whole answer is `{"name": "f", "parameters": {...}}`, several
separated by `;`, optionally after `<|python_tag|>` (kept in the text only when special tokens are
not skipped). An answer that does not start with `{` is plain content."""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.json_calls import JsonCallSequenceStream

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        return JsonCallSequenceStream(open="{", separator=";", lead=(PYTHON_TAG,))


class Llama4JsonToolParser(Llama3JsonToolParser):
    """vLLM's `llama4_json`: Llama 4 in the JSON format of Llama 3's templates."""

    name = "llama4_json"
