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
    stream_open_arguments,
)
from ksana_llm.server.tool_parsers.json_scan import (OpenValue, open_value_at, partial_value, skip_ws,
                                                    value_end)


@dataclass
class BodyScan:
    """What a call body says so far: `name` once complete, the arguments text so far, and where
    in the body an unfinished string or container value starts (`open_at`, when that is where
    the body stops making sense yet; `open_is_arguments`: the arguments', else another key's,
    which is only read on, not streamed)."""

    name: str | None = None
    arguments: str = ""
    open_at: int | None = None
    open_is_arguments: bool = True
    next_at: int | None = None  # where another call starts in the same body, once this one ended
    call_id: str | None = None  # the call's id, where the markup gives one
    # Nothing later in the body can change the call or start another (its arguments value is
    # complete, and the format puts one call in a body or the text after it is no call): the
    # body is not read again, however much more of it comes.
    final: bool = False


BodyParser = Callable[[str], BodyScan]


def named_arguments(name: str, body: str, pos: int) -> BodyScan:
    """The call `name` whose arguments are the JSON value at `body[pos:]` (after whitespace),
    for formats that write the name outside the JSON (DeepSeek's, Mistral's)."""
    start = skip_ws(body, pos)
    end = value_end(body, start)
    if end >= 0:  # complete: what follows it in the body is not the call's
        return BodyScan(name, body[start:end], final=True)
    return BodyScan(name, partial_value(body, start), open_at=open_value_at(body, start))


class TaggedToolStream(ToolCallStream):
    """`start` BODY `end` regions are calls, `ignored` tags vanish, everything else is content.

    The first end tag after a start tag ends the call, even where it would sit inside a JSON
    string of the body: in the formats served here each tag is one special token, so a model
    that writes it means it, and a broken escape in an argument (`"C:\\tmp\\"` written with
    single backslashes) must not swallow the calls and text after it. vLLM and SGLang split
    the same way. A region whose body never yields a name is given back as content, tags
    included, once it closes; a region that yielded a name stays a call even if the rest is
    malformed (its name and arguments were already streamed).

    `end` None: a format without an end tag (Mistral's), where a call runs to the next start
    tag or to the end of the output. `more`: other (start, end) pairs that open and close
    regions read the same way (xLAM's fences and tags), for formats with several spellings.
    """

    def __init__(self, start: str, end: str | None, parse_body: BodyParser,
                 ignored: tuple[str, ...] = (), *,
                 on_new_body: Callable[[], None] | None = None,
                 end_in_body: bool = False,
                 more: tuple[tuple[str, str | None], ...] = ()) -> None:
        """`on_new_body`: told when a call's body starts, for a `parse_body` that keeps what it
        read of the body so far (which only grows until then). `end_in_body`: the end tag is
        read as the body's last text too (DeepSeek-V3.2's `</｜DSML｜invoke>` closes the
        function whose parameters the body lists)."""
        self._on_new_body = on_new_body
        self._end_in_body = end_in_body
        self._ends: dict[str, str | None] = {start: end, **dict(more)}
        self._start = start  # the start tag of the open region (or the last one)
        self._end = end  # its end tag
        self._parse_body = parse_body
        self._content_markers = (*self._ends, *ignored)
        self._buffer = ""  # text not yet committed anywhere
        self._body: str | None = None  # the open call's body so far, None outside calls
        self._final = False  # the open call's body was read for good (BodyScan.final)
        self._call: CallProgress | None = None
        self._name: str | None = None  # the open call's name, once known
        self._open: OpenValue | None = None  # the body's unfinished arguments value
        self._num_calls = 0
        self._gate = ContentGate()

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
                if marker in self._ends:
                    self._start, self._end = marker, self._ends[marker]
                    self._new_body("")
                continue
            end = self._start if self._end is None else self._end
            j = self._buffer.find(end)
            if j < 0:
                # Hold back what may be the start of the end tag: wait for more text.
                self._take_body(len(self._buffer) - held_prefix(self._buffer, (end,)))
                self._progress(out)
                return out
            self._take_body(j)
            if self._end is not None:  # else the start tag stays, opening the next call
                self._buffer = self._buffer[len(self._end):]
            self._close(out, self._end or "")

    def _new_body(self, body: str) -> None:
        self._body = body
        self._final = False
        if self._on_new_body is not None:
            self._on_new_body()

    def _take_body(self, n: int) -> None:
        """Move the first `n` buffered characters into the body."""
        taken, self._buffer = self._buffer[:n], self._buffer[n:]
        self._body = (self._body or "") + taken

    def _progress(self, out: ParsedDelta) -> None:
        while not self._final:
            body = self._body or ""
            if self._open is not None and not self._open.advance(body):
                # Inside a long value: nothing before it can change, so only the new text is
                # read (a full rescan per piece would cost quadratic time).
                stream_open_arguments(out, self._call, self._name, body, self._open)
                return
            scan = self._parse_body(body)
            self._final = scan.final and scan.name is not None and scan.next_at is None
            self._open = None if scan.open_at is None else \
                OpenValue(body, scan.open_at, is_arguments=scan.open_is_arguments)
            if scan.name is None:
                return
            self._name = scan.name
            if self._call is None:
                self._call = CallProgress(self._num_calls)
                self._num_calls += 1
                self._gate.had_call = True
            delta = self._call.update(scan.name, scan.arguments, scan.call_id)
            if delta is not None:
                out.tool_calls.append(delta)
            if scan.next_at is None:
                return
            # Several calls between one pair of tags (models do this): each is a call of its own.
            self._end_call(out)
            self._new_body(body[scan.next_at:])

    def _end_call(self, out: ParsedDelta) -> None:
        if self._call is not None:
            closing = self._call.close()
            if closing is not None:
                out.tool_calls.append(closing)
        self._call = None
        self._name = None
        self._open = None

    def _close(self, out: ParsedDelta, end_tag: str, cut_off: bool = False) -> None:
        """End the open region, which `end_tag` closed (`cut_off`: the output ended inside)."""
        self._open = None  # the body is whole now: parse it once more, all of it
        read_end = ""  # the text added to the body to be read as its end
        if self._end_in_body:
            # A named call cut off reads as if its end tag were there: its parameters so far
            # make a whole arguments object (the tag closes the function's last value too).
            read_end = (self._end or "") if cut_off and self._name is not None else end_tag
            self._body = (self._body or "") + read_end
        self._progress(out)
        if self._call is None:  # never a call: the region (what is left of it) was content
            body = self._body or ""
            written = body[:len(body) - len(read_end)]
            out.content += self._gate.push(self._start + written + end_tag)
        self._end_call(out)
        self._body = None

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._body is not None:  # cut off inside a call (length limit, or no end tag)
            self._take_body(len(self._buffer))
            self._progress(out)  # (the name may be in the text held back as a possible tag)
            self._close(out, "", cut_off=True)
        out.content += self._gate.push(self._buffer)
        self._buffer = ""
        out.content += self._gate.finish()
        return out
