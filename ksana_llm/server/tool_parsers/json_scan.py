"""A tolerant scanner for JSON that may still be arriving: where a value ends, if it has.

Streaming tool-call parsers need to know, for text cut at any point, which part of a tool-call
object is certain: the function name once its string is closed, and the raw text of the arguments
so far. Raw argument text is what the parsers return (streamed or not), so the streamed fragments
always add up to exactly the final `arguments` string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
_LITERAL_END = WHITESPACE + ",]}:"

INCOMPLETE = -1  # the text ends inside the value
INVALID = -2  # the text cannot be JSON at this point


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> int:
    """End (exclusive) of the JSON string starting at `text[pos] == '"'`, or INCOMPLETE."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return INCOMPLETE


def partial_value(text: str, pos: int) -> str:
    """The JSON value at `pos` as far as it goes: all of it once complete, the text so far for an
    unfinished object or array, "" otherwise (so the result only ever grows as text arrives)."""
    end = value_end(text, pos)
    if end >= 0:
        return text[pos:end]
    if end == INCOMPLETE and pos < len(text) and text[pos] in "{[":
        return text[pos:]
    return ""


def value_end(text: str, pos: int) -> int:
    """End (exclusive) of the JSON value starting at `pos` (no leading whitespace), INCOMPLETE if
    the text stops inside it, INVALID if no JSON value starts there. Containers are matched by
    brackets only (their insides are not validated: `json.loads` does that once complete)."""
    if pos >= len(text):
        return INCOMPLETE
    c = text[pos]
    if c == '"':
        return string_end(text, pos)
    if c in "{[":
        depth = 0
        i = pos
        while i < len(text):
            c = text[i]
            if c == '"':
                end = string_end(text, i)
                if end == INCOMPLETE:
                    return INCOMPLETE
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return INCOMPLETE
    if c in "-0123456789tfn":
        i = pos
        while i < len(text) and text[i] not in _LITERAL_END:
            i += 1
        if i == len(text):
            return INCOMPLETE  # a number or literal may go on
        try:
            json.loads(text[pos:i])
        except ValueError:
            return INVALID
        return i
    return INVALID


class OpenValue:
    """An unfinished JSON string or container starting at `start` (`text[start]` one of `"{[`),
    read incrementally: each `advance` reads only the text that arrived since the last one, so a
    long value streamed in small pieces costs linear time, not a rescan per piece. Brackets are
    matched as in `value_end`."""

    def __init__(self, text: str, start: int, *, is_arguments: bool = True) -> None:
        self.start = start
        # Whether it is a call's arguments (streamed as they grow) or another key's value, read
        # only so that the text before it is not scanned again.
        self.is_arguments = is_arguments
        self.end: int | None = None  # exclusive, once the value is closed
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.advance(text)

    def advance(self, text: str) -> bool:
        """Read what `text` (the same text, grown) added; True once the value is closed."""
        i, n = self._pos, len(text)
        while i < n and self.end is None:
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.end = i + 1
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = i + 1
            i += 1
        self._pos = i
        return self.end is not None

    def partial(self, text: str) -> str:
        """The value's text so far as `partial_value` gives it: a container's text, "" for a
        string (it is decoded only once complete)."""
        return text[self.start:] if text[self.start] in "{[" else ""


def open_value_at(text: str, pos: int) -> int | None:
    """`pos` if an unfinished string or container starts there (worth an `OpenValue`)."""
    if pos < len(text) and text[pos] in '"{[' and value_end(text, pos) == INCOMPLETE:
        return pos
    return None


def _loads_string(text: str) -> str | None:
    """A complete JSON string literal decoded; None if it is not valid JSON (a raw control
    character or a bad escape, which `string_end` lets through)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


@dataclass
class CallObject:
    """What is known of one `{"name": ..., "arguments" | "parameters": ...}` object so far."""

    name: str | None = None
    args_start: int | None = None  # where the arguments value starts in the scanned text
    args_end: int | None = None  # where it ends, once complete
    end: int | None = None  # just past the closing brace, once the object is complete
    invalid: bool = False  # not a JSON object (or a malformed one)
    # Where an unfinished string or container value starts, when the scan stopped inside one
    # (any key's: a long answer that is JSON but no call must not be rescanned per piece).
    open_at: int | None = None

    def arguments(self, text: str) -> str:
        """The raw arguments text so far ("" if none yet). A string-valued arguments field (a
        model that JSON-encodes its arguments twice) is decoded, once complete, if what it holds
        is JSON; otherwise the string literal itself is the arguments (still JSON)."""
        if self.args_start is None:
            return ""
        if self.args_end is None:
            # Only a container's text can be sent before it ends: a partial literal may still
            # turn out invalid, and a partial string still has to be decoded.
            return text[self.args_start:] if text[self.args_start] in "{[" else ""
        raw = text[self.args_start:self.args_end]
        if raw.startswith('"'):
            decoded = _loads_string(raw)
            if decoded is not None and _is_json(decoded):
                return decoded
        return raw


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


ARGUMENT_KEYS = ("arguments", "parameters")


def scan_call_object(text: str, pos: int) -> CallObject:
    """Scan the object starting at `text[pos] == '{'` as far as the text goes."""
    out = CallObject()
    if pos >= len(text) or text[pos] != "{":
        out.invalid = True
        return out
    i = skip_ws(text, pos + 1)
    if i < len(text) and text[i] == "}":
        out.end = i + 1
        return out
    while True:
        if i >= len(text):
            return out
        if text[i] != '"':
            out.invalid = True
            return out
        key_end = string_end(text, i)
        if key_end == INCOMPLETE:
            return out
        key = _loads_string(text[i:key_end])
        if key is None:
            out.invalid = True
            return out
        i = skip_ws(text, key_end)
        if i >= len(text):
            return out
        if text[i] != ":":
            out.invalid = True
            return out
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return out
        end = value_end(text, i)
        if end == INVALID:
            out.invalid = True
            return out
        if key in ARGUMENT_KEYS and out.args_start is None:
            out.args_start = i
            if end != INCOMPLETE:
                out.args_end = end
        if end == INCOMPLETE:
            if text[i] in '"{[':
                out.open_at = i
            return out
        if key == "name" and out.name is None:
            name = _loads_string(text[i:end]) if text[i] == '"' else None
            if not name:
                out.invalid = True
                return out
            out.name = name
        i = skip_ws(text, end)
        if i >= len(text):
            return out
        if text[i] == "}":
            out.end = i + 1
            return out
        if text[i] != ",":
            out.invalid = True
            return out
        i = skip_ws(text, i + 1)
