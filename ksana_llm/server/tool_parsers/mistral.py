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

import uuid

from ksana_llm.server.tool_parsers.base import FUNCTION_NAME, ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.hermes import parse_json_body
from ksana_llm.server.tool_parsers.json_scan import skip_ws
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream, named_arguments

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


def parse_mistral_body(body: str) -> BodyScan:
    start = skip_ws(body, 0)
    if start == len(body):
        return BodyScan()
    if body[start] in "[{":
        return parse_json_body(body)
    # The form is told by what comes first after the name: `[ARGS]`, or the arguments' `{`
    # (an `[ARGS]` inside the arguments is text, streamed or not).
    brace = body.find("{")
    args = body.find(ARGS, 0, brace if brace >= 0 else len(body))
    if args >= 0:
        head, arguments_at = body[:args], args + len(ARGS)
    elif brace >= 0:
        head, arguments_at = body[:brace], brace
    else:
        return BodyScan()  # the name (or [ARGS] after it) may still be coming
    name = head.split(CALL_ID, 1)[0].strip()
    if not FUNCTION_NAME.fullmatch(name):
        return BodyScan()
    return named_arguments(name, body, arguments_at)


class MistralToolParser(ToolParser):
    name = "mistral"
    reads_special_tokens = True

    def stream(self) -> ToolCallStream:
        return TaggedToolStream(TOOL_CALLS, None, parse_mistral_body)

    @staticmethod
    def new_call_id(name: str, index: int) -> str:
        return uuid.uuid4().hex[:9]
