"""Records and the streaming contract shared by every tool-call parser.

A parser turns model text into content plus tool calls. Each parser has one incremental machine
(`ToolCallStream`); the non-streamed `extract` runs that same machine over the whole text, so a
streamed answer always adds up to exactly the non-streamed one, however the text was chunked.
A stream commits only what later text cannot change: content that could still turn out to be the
start of a tool-call tag is held back, a function name is sent once it is complete, and argument
text is sent as it arrives (the raw JSON the model wrote, which is also the final `arguments`).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ksana_llm.server.tool_parsers.json_scan import WHITESPACE, OpenValue, skip_ws

logger = logging.getLogger("ksana_llm.server")

# OpenAI's rule for function names: markup whose name breaks it is text, not a call. (A name
# of dots and dashes alone, prose's "<tool_call> ... </tool_call>", is none either.)
FUNCTION_NAME = re.compile(r"(?=.*[A-Za-z0-9_])[A-Za-z0-9_.\-]{1,64}")


def json_text(value: object) -> str:
    """`value` as JSON text, for arguments a parser builds from decoded values (Python literals,
    tagged parameters). Those can hold surrogates (a Python literal's `'\\ud83d\\ude00'` is two
    of them, not one emoji), which no UTF-8 response can carry: pairs are joined, and what is
    still alone is written as a JSON escape. ValueError/TypeError for no JSON form (NaN, a set)."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        try:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16")
            text.encode()
        except UnicodeError:
            return json.dumps(value, allow_nan=False)
    return text


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it


@dataclass
class ToolCallDelta:
    """New output of tool call `index`: its name on the first delta, then argument text. `id`:
    the call's id where the model's markup gives one (Kimi-K2's `functions.NAME:0`, which its
    template writes back), on the first delta; otherwise the server makes one."""

    index: int
    name: str | None = None
    arguments: str = ""
    id: str | None = None


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


def coalesce(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Adjacent deltas of one call merged (its name, then arguments text), so one streamed chunk
    names each call index once, as OpenAI streams them."""
    out: list[ToolCallDelta] = []
    for call in calls:
        if out and out[-1].index == call.index and call.name is None:
            out[-1] = ToolCallDelta(call.index, out[-1].name, out[-1].arguments + call.arguments,
                                    out[-1].id)
        else:
            out.append(call)
    return out


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def collect(deltas: list[ParsedDelta]) -> ParsedOutput:
    """Fold a stream's deltas into the final content and calls."""
    content = "".join(d.content for d in deltas)
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        for call in d.tool_calls:
            if call.name is not None:
                names[call.index] = call.name
            args.setdefault(call.index, []).append(call.arguments)
    calls = [ToolCall(names[i], "".join(args.get(i, []))) for i in sorted(names)]
    return ParsedOutput(content or None, calls)


class ToolCallStream(ABC):
    """Incremental extraction over one model output; `feed` text as it comes, then `finish`."""

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta: ...

    @abstractmethod
    def finish(self) -> ParsedDelta: ...


class ToolParser(ABC):
    """A named output format. Stateless: `stream()` makes the per-output state."""

    name: ClassVar[str]
    # Whether it reads the output's special tokens (GPT-OSS's harmony): the server then decodes
    # the output with them, whatever the request's skip_special_tokens says.
    reads_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def stream(self) -> ToolCallStream: ...

    def stream_for(self, tools: list[dict[str, Any]] | None) -> ToolCallStream:
        """`stream()` for a request that offers `tools` (OpenAI function tools, checked).
        Formats whose markup carries untyped text (Qwen3-Coder's) read the parameters' types
        there; the others ignore them."""
        return self.stream()

    @staticmethod
    def new_call_id(name: str, index: int) -> str:
        """A fresh id for call `index` (of the answer's calls), to function `name`, where the
        markup gives none (OpenAI's shape). Formats whose chat template reads the ids a client
        sends back override it (Mistral's 9 characters, Kimi-K2's `functions.NAME:N`)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def extract(self, text: str) -> ParsedOutput:
        stream = self.stream()
        return collect([stream.feed(text), stream.finish()])


class WholeTextToolParser(ToolParser):
    """A parser written as one function of the whole output (`parse`), for formats a plugin
    adds without writing an incremental machine: a streamed answer then sends its content and
    calls together when the output ends (the same result as not streamed, later)."""

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput: ...

    def stream(self) -> ToolCallStream:
        return _WholeTextStream(self)


class _WholeTextStream(ToolCallStream):
    def __init__(self, parser: WholeTextToolParser) -> None:
        self._parser = parser
        self._parts: list[str] = []

    def feed(self, text: str) -> ParsedDelta:
        self._parts.append(text)
        return ParsedDelta()

    def finish(self) -> ParsedDelta:
        text = "".join(self._parts)
        try:
            out = self._parser.parse(text)
            checked = _checked_output(out)
        except Exception:  # noqa: BLE001 - a plugin's bug must not fail the request
            # As with the built-in parsers' malformed markup: the text stays content.
            logger.exception("tool-call parser %r failed on an output; it is sent as content",
                             type(self._parser).name)
            return ParsedDelta(text)
        return ParsedDelta(checked.content or "", [ToolCallDelta(i, call.name, call.arguments)
                                                   for i, call in enumerate(checked.tool_calls)])


def _checked_output(out: object) -> ParsedOutput:
    """`out` if it is what `parse` promises (TypeError saying what is not)."""
    if not isinstance(out, ParsedOutput) or not (out.content is None or isinstance(out.content, str)):
        raise TypeError(f"parse must return a ParsedOutput(content: str | None, tool_calls), "
                        f"got {out!r}")
    for call in out.tool_calls:
        if not isinstance(call, ToolCall) or not isinstance(call.name, str) \
                or not isinstance(call.arguments, str):
            raise TypeError(f"a tool call must be ToolCall(name: str, arguments: JSON text), "
                            f"got {call!r}")
    return out


def stream_open_arguments(out: ParsedDelta, call: CallProgress | None, name: str | None,
                          text: str, value: OpenValue) -> None:
    """While a call's arguments value is unfinished (`value`, in `text`), add what is new of it
    to `out`: a container's text as it grows; a string's nothing (it is decoded once whole)."""
    if call is None or name is None or not value.is_arguments or text[value.start] not in "{[":
        return
    delta = call.update_tail(name, text, value.start)
    if delta is not None:
        out.tool_calls.append(delta)


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker: text that
    must not be committed yet because the next chunk may complete a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


@dataclass
class OutputStart:
    """The start of an output that may be all calls (`[...]`, `{...}`): its leading whitespace
    (`prefix`, content if the output turns out to be content) and `lead` tags (dropped, unless
    `lead_is_text`: a word such as Phi-4-mini's `functools`, which a plain answer may begin
    with, goes back into the content with the whitespace)."""

    lead: tuple[str, ...] = ()
    prefix: str = ""
    lead_is_text: bool = False

    def scan(self, text: str, pos: int) -> tuple[int, bool]:
        """Read on from `pos`: (where the first visible text after whitespace and lead tags
        starts, whether it is decided there -- False while only whitespace came, or what may
        still be a lead tag being spelled out)."""
        while True:
            i = skip_ws(text, pos)
            self.prefix += text[pos:i]
            rest = text[i:]
            tag = next((t for t in self.lead if rest.startswith(t)), None)
            if tag is None:
                return i, bool(rest) and held_prefix(rest, self.lead) < len(rest)
            if self.lead_is_text:
                self.prefix += tag
            pos = i + len(tag)


class ContentGate:
    """Content passes through, except whitespace, which waits for the next visible character:
    the blank lines models put around tool calls are not content. Waiting whitespace is dropped
    when no content was sent yet but a call was (the lines after a leading call), and at the
    end if the output had calls; otherwise it goes out with the text after it."""

    def __init__(self) -> None:
        self._pending = ""
        self._sent = False
        self.had_call = False

    def push(self, text: str) -> str:
        if not text:
            return ""
        stripped = text.rstrip(WHITESPACE)
        if not stripped:
            self._pending += text
            return ""
        if not self._sent and self.had_call:
            self._pending = ""
            stripped = stripped.lstrip(WHITESPACE)
        out = self._pending + stripped
        self._pending = text[len(text.rstrip(WHITESPACE)):]
        self._sent = True
        return out

    def finish(self) -> str:
        pending, self._pending = self._pending, ""
        return "" if self.had_call else pending


@dataclass
class CallProgress:
    """What a stream already sent of one call."""

    index: int
    name_sent: bool = False
    args_sent: int = 0  # characters of arguments sent

    def update(self, name: str | None, arguments: str,
               call_id: str | None = None) -> ToolCallDelta | None:
        """The delta that brings the client up to (name, arguments); None if nothing is new.
        `call_id`: the call's id as the markup gives it, sent with the name."""
        if name is None:
            return None  # arguments wait for the name: a call is announced by its name
        delta = ToolCallDelta(self.index)
        if not self.name_sent:
            delta.name = name
            delta.id = call_id
            self.name_sent = True
        if len(arguments) > self.args_sent:
            delta.arguments = arguments[self.args_sent:]
            self.args_sent = len(arguments)
        return delta if delta.name is not None or delta.arguments else None

    def update_tail(self, name: str, text: str, start: int) -> ToolCallDelta | None:
        """`update` with the arguments `text[start:]` (an unfinished container), slicing only
        what is new: a long argument streamed piece by piece is not copied once per piece."""
        delta = self.update(name, "")
        new = text[start + self.args_sent:]
        if not new:
            return delta
        self.args_sent += len(new)
        if delta is None:
            return ToolCallDelta(self.index, arguments=new)
        delta.arguments = new
        return delta

    def close(self) -> ToolCallDelta | None:
        """The call ended: one without any arguments text gets "{}", which clients can load as
        JSON (as they do every call's `arguments`)."""
        if self.name_sent and self.args_sent == 0:
            self.args_sent = 2
            return ToolCallDelta(self.index, arguments="{}")
        return None
