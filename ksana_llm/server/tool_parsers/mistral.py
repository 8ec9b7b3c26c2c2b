"""Mistral's tool calls, which follow its `[TOOL_CALLS]` special token and run to the end of the
output (or to the next `[TOOL_CALLS]`):

- tokenizers before v11 (Mistral-7B-Instruct-v0.3, Nemo, Small 2409): a JSON array of call
  objects, `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`;
- v11 and later (Small 3.x, Magistral, Devstral): one `[TOOL_CALLS]` per call, `f[ARGS]{...}`,
  with `[CALL_ID]id` between the name and `[ARGS]` where the tokenizer writes one, and `f{...}`
  in the first v11 releases.

Those markers are special tokens, so the server decodes the output with special tokens for this
parser. Mistral's chat templates refuse tool-call ids that are not 9 letters or digits, so the
calls it reads get such ids (a client sends them back with the conversation).
"""

from __future__ import annotations

import re
import uuid

from ksana_llm.server.tool_parsers.base import ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.hermes import parse_json_body
from ksana_llm.server.tool_parsers.json_scan import skip_ws
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream, named_arguments

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
# OpenAI's rule for function names: a body whose "name" breaks it is text, not a call.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def parse_mistral_body(body: str) -> BodyScan:
    start = skip_ws(body, 0)
    if start == len(body):
        return BodyScan()
    if body[start] in "[{":
        return parse_json_body(body)
    args = body.find(ARGS)
    if args >= 0:
        head, arguments_at = body[:args], args + len(ARGS)
    else:
        brace = body.find("{")
        if brace < 0:
            return BodyScan()  # the name (or [ARGS] after it) may still be coming
        head, arguments_at = body[:brace], brace
    name = head.split(CALL_ID, 1)[0].strip()
    if not _FUNCTION_NAME.fullmatch(name):
        return BodyScan()
    return named_arguments(name, body, arguments_at)


class MistralToolParser(ToolParser):
    name = "mistral"
    reads_special_tokens = True

    def stream(self) -> ToolCallStream:
        return TaggedToolStream(TOOL_CALLS, None, parse_mistral_body)

    @staticmethod
    def new_call_id() -> str:
        return uuid.uuid4().hex[:9]
