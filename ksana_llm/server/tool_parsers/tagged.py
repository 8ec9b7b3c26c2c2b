"""Formats where each tool call sits between a start and an end tag, with content around them
(hermes / qwen3 `<tool_call>...</tool_call>`, DeepSeek's `<｜tool▁call▁begin｜>...`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ksana_llm.server.tool_parsers.base import (
    CallProgress,
    ContentGate,
    ParsedDelta,
    ToolCallStream,
    held_prefix,
)


@dataclass
class BodyScan:
    """What a call body says so far: `name` once complete, the arguments text so far."""

    name: str | None = None
    arguments: str = ""


BodyParser = Callable[[str], BodyScan]


class TaggedToolStream(ToolCallStream):
    """`start` BODY `end` regions are calls, `ignored` tags vanish, everything else is content.

    A region whose body never yields a name is given back as content, tags included, once it
    closes; a region that yielded a name stays a call even if the rest is malformed (its name
    and arguments were already streamed).
    """

    def __init__(self, start: str, end: str, parse_body: BodyParser,
                 ignored: tuple[str, ...] = ()) -> None:
        self._start = start
        self._end = end
        self._parse_body = parse_body
        self._content_markers = (start, *ignored)
        self._buffer = ""  # text not yet committed anywhere
        self._body: str | None = None  # the open call's body so far, None outside calls
        self._call: CallProgress | None = None
        self._num_calls = 0
        self._gate = ContentGate()
        self._in_string = False  # inside a JSON string of the body, at its end
        self._escaped = False

    def _find_marker(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for marker in self._content_markers:
            i = self._buffer.find(marker)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, marker)
        return best

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            if self._body is None:
                found = self._find_marker()
                if found is None:
                    cut = len(self._buffer) - held_prefix(self._buffer, self._content_markers)
                    out.content += self._gate.push(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return out
                i, marker = found
                out.content += self._gate.push(self._buffer[:i])
                self._buffer = self._buffer[i + len(marker):]
                if marker == self._start:
                    self._body = ""
                    self._in_string = self._escaped = False
                continue
            j, cut = self._find_end()
            if j < 0:
                self._take_body(cut)
                self._progress(out)
                return out
            self._take_body(j)
            self._buffer = self._buffer[len(self._end):]
            self._close(out, self._end)

    def _find_end(self) -> tuple[int, int]:
        """(index of the end tag in the buffer or -1, how much of the buffer is surely body).

        An end tag inside a JSON string of the body (an argument that mentions the tag) does
        not end the call."""
        buf, end = self._buffer, self._end
        in_string, escaped = self._in_string, self._escaped
        cut = len(buf)
        for i, c in enumerate(buf):
            if not in_string:
                if buf.startswith(end, i):
                    return i, i
                if cut == len(buf) and end.startswith(buf[i:]):
                    cut = i  # may be the start of the end tag: wait for more text
            if escaped:
                escaped = False
            elif c == "\\" and in_string:
                escaped = True
            elif c == '"':
                in_string = not in_string
        return -1, cut

    def _take_body(self, n: int) -> None:
        """Move the first `n` buffered characters into the body, tracking JSON string state."""
        taken, self._buffer = self._buffer[:n], self._buffer[n:]
        for c in taken:
            if self._escaped:
                self._escaped = False
            elif c == "\\" and self._in_string:
                self._escaped = True
            elif c == '"':
                self._in_string = not self._in_string
        self._body = (self._body or "") + taken

    def _progress(self, out: ParsedDelta) -> None:
        scan = self._parse_body(self._body or "")
        if scan.name is None:
            return
        if self._call is None:
            self._call = CallProgress(self._num_calls)
            self._num_calls += 1
            self._gate.had_call = True
        delta = self._call.update(scan.name, scan.arguments)
        if delta is not None:
            out.tool_calls.append(delta)

    def _close(self, out: ParsedDelta, end_tag: str) -> None:
        self._progress(out)
        if self._call is None:  # never a call: the region was content after all
            out.content += self._gate.push(self._start + (self._body or "") + end_tag)
        self._body = None
        self._call = None

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._body is not None:  # cut off inside a call (length limit, or no end tag)
            self._take_body(len(self._buffer))
            self._close(out, "")
        out.content += self._gate.push(self._buffer)
        self._buffer = ""
        out.content += self._gate.finish()
        return out
