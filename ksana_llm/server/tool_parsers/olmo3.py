"""AllenAI Olmo 3's tool calls (vLLM's `olmo3`): pythonic calls, one per line, in a block,

    <function_calls>
    get_weather(city="Paris", days=3)
    get_time(tz="UTC")
    </function_calls>

with content around it. Values are Python literals, or JSON's `null` / `true` / `false` (Olmo 3
sees its tools as JSON schemas, and writes those too); each call goes out whole when its closing
parenthesis arrives, as the `pythonic` format's do (`pythonic.CallExtent`, `python_call`).
Calls on one line separated by commas are read too. A block whose first call is not one
(positional arguments, prose) is content, tags included, as is what follows a call in the block
that is not one (the calls before it stand). vLLM also reads bare calls without the tags when
not streaming; here, as when it streams, calls are only read inside the block.
"""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import ToolCall, ToolCallStream, ToolParser
from ksana_llm.server.tool_parsers.json_scan import WHITESPACE
from ksana_llm.server.tool_parsers.pythonic import NOT_A_CALL, CallExtent, python_call
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream

BLOCK_START = "<function_calls>"
BLOCK_END = "</function_calls>"
_SEPARATORS = WHITESPACE + ","


class PythonicLinesBody:
    """The body parser of one stream: the first call in a block's body, read on from where it
    stopped as the body grows (a long argument is read once), and where the next one starts.
    `restart` when the stream opens a new body (the rest of the block after a call)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._pos = 0  # where the call (or the text before it) is read from
        self._extent: CallExtent | None = None
        self._call: ToolCall | None = None  # the body's call, once complete
        self._not_a_call = False

    def __call__(self, body: str) -> BodyScan:
        if self._call is None and not self._read_call(body):
            return BodyScan()
        while self._pos < len(body) and body[self._pos] in _SEPARATORS:
            self._pos += 1
        call = self._call
        assert call is not None
        # Text after the call and its separators is the next call (or no call: content).
        return BodyScan(call.name, call.arguments,
                        next_at=self._pos if self._pos < len(body) else None)

    def _read_call(self, body: str) -> bool:
        """Whether the body's first call is complete (now or before)."""
        if self._not_a_call:
            return False
        if self._extent is None:
            while self._pos < len(body) and body[self._pos] in WHITESPACE:
                self._pos += 1
            if self._pos >= len(body):
                return False
            c = body[self._pos]
            if not (c.isalpha() or c == "_"):
                self._not_a_call = True
                return False
            self._extent = CallExtent(self._pos)
        end = self._extent.read(body)
        if end is None:
            return False
        call = None if end == NOT_A_CALL else \
            python_call(body[self._extent.start:end], json_names=True)
        if call is None:
            self._not_a_call = True
            return False
        self._call, self._pos = call, end
        return True


class Olmo3ToolParser(ToolParser):
    name = "olmo3"

    def stream(self) -> ToolCallStream:
        body = PythonicLinesBody()
        return TaggedToolStream(BLOCK_START, BLOCK_END, body, on_new_body=body.restart)
