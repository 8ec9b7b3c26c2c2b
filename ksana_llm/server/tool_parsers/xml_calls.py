"""Tool-call formats that write each parameter in tags of its own rather than as JSON
(Qwen3-Coder's `<parameter=KEY>`, DeepSeek-V3.2's `<｜DSML｜parameter name="KEY" ...>`): the
arguments object is built here, one parameter at a time as each closing tag arrives
(`{"a": 1`, then `, "b": "x"`, then `}` at the function's end), so a long parameter costs linear
time however finely it streams. What a parameter's text means (its JSON value) is the format's
`ValueReader`."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ksana_llm.server.tool_parsers.base import FUNCTION_NAME, ToolCallStream, ToolParser, json_text
from ksana_llm.server.tool_parsers.json_scan import skip_ws
from ksana_llm.server.tool_parsers.tagged import BodyScan, TaggedToolStream

Schemas = Mapping[str, Mapping[str, Any]]  # function name -> its parameters' JSON schemas
# (the parameter's header: the text between its opening tag's prefix and ">", its raw value
# text, the function's schema properties) -> (the parameter's name, its JSON value)
ValueReader = Callable[[str, str, Mapping[str, Any]], tuple[str, Any]]


def parameter_schemas(tools: list[dict[str, Any]] | None) -> Schemas:
    """Each offered function's `parameters.properties`."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties")
        if isinstance(function.get("name"), str) and isinstance(properties, Mapping):
            out[function["name"]] = properties
    return out


def declared_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema declares (`type`, a list of them, or anyOf/oneOf)."""
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    options = schema.get("anyOf") or schema.get("oneOf") or []
    return [k for option in options if isinstance(option, Mapping)
            for k in declared_types(option)]


def read_literal(text: str) -> tuple[bool, Any]:
    """(True, the value) if `text` is JSON, or a Python literal (single quotes, True) that has a
    JSON form (tuples as lists); (False, None) otherwise."""
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(text)
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            continue
        try:
            return True, json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError, RecursionError):
            return False, None
    return False, None


@dataclass(frozen=True)
class ParameterMarkup:
    """Where a format's tags sit in one call's body: `function` then the name, up to the first
    of `name_ends`, each parameter as `parameter` HEADER `header_end` [`value_open`] VALUE
    `parameter_end`, then `function_end`. `call_end`: the tag that ends the whole call (read in
    the body: `TaggedToolStream`'s `end_in_body`), which ends the function too where a model
    left `function_end` out. `value_open`: a tag opening the value after the header (GLM's
    `<arg_value>`), whitespace before it skipped."""

    function: str
    parameter: str
    parameter_end: str
    function_end: str
    call_end: str = ""
    name_ends: tuple[str, ...] = (">",)
    header_end: str = ">"
    value_open: str = ""

    @property
    def function_ends(self) -> tuple[str, ...]:
        """What ends a function: its end tag, the call's, or (where the call may hold several
        functions: `function` is a tag) the next function's start."""
        return tuple(tag for tag in (self.function_end, self.call_end, self.function) if tag)

    @property
    def longest_tag(self) -> int:
        return max(len(tag) for tag in (self.parameter, self.parameter_end, self.header_end,
                                        *self.function_ends, *self.name_ends))


def unquoted(text: str) -> str:
    """`text` stripped, and out of the quotes around it if it has them."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


class ParameterCallBody:
    """The body parser of one stream. A call's body only grows until the next call starts
    (`restart`), so it resumes where it stopped: the parameters read so far are kept as the
    arguments text they gave."""

    def __init__(self, markup: ParameterMarkup, read_value: ValueReader,
                 schemas: Schemas) -> None:
        self._markup = markup
        self._read_value = read_value
        self._schemas = schemas
        self.restart()

    def restart(self) -> None:
        self._name: str | None = None
        self._properties: Mapping[str, Any] = {}
        self._pos = 0  # the body before it is read
        self._not_a_call = False  # the body's name is none a function may have
        self._name_from = 0  # where to look on for the end of the name
        self._opening = -1  # where the parameter whose header is incomplete opens
        self._header_from = 0  # where to look on for the end of its header
        self._header: str | None = None  # the open parameter's header
        self._value_start = 0  # where its value starts
        self._search_from = 0  # where to look on for the end of its value
        self._arguments = "{"
        self._done = False
        self._end_at = 0  # where the function's end tag ends, once it is done

    def __call__(self, body: str) -> BodyScan:
        if self._name is None and not self._read_name(body):
            return BodyScan()
        while not self._done and self._read_parameter(body):
            pass
        if not self._done:
            return BodyScan(self._name, self._arguments)
        next_at, more = self._next_function(body)
        return BodyScan(self._name, self._arguments + "}", next_at=next_at, final=not more)

    def _next_function(self, body: str) -> tuple[int | None, bool]:
        """After the function: (where the next one in the body starts, if one does; whether
        the body may still give one). Only formats whose functions open with a tag have
        several per call (Qwen3-Coder's `<function=` blocks, MiniMax-M2's invokes)."""
        opener = self._markup.function
        if not opener:
            return None, False
        at = skip_ws(body, self._end_at)
        if body.startswith(opener, at):
            return at, True
        return None, opener.startswith(body[at:])  # (whitespace, or the tag coming)

    def _end_function(self, body: str, closing: int) -> None:
        """The function ends at `closing` (one of `function_ends`)."""
        self._done = True
        tag = self._markup.function_end
        self._end_at = closing + len(tag) if tag and body.startswith(tag, closing) else closing

    def _read_name(self, body: str) -> bool:
        """Whether the body's name is read (now or before). Each search goes on from where the
        last one stopped: a long region that is no call (JSON in the tags) costs linear time."""
        if self._not_a_call:
            return False
        markup = self._markup
        start = skip_ws(body, 0)
        if not body.startswith(markup.function, start):
            if not markup.function.startswith(body[start:]):
                self._not_a_call = True  # (the region is then content)
            return False  # (or the tag is still coming)
        start += len(markup.function)
        close = _first(body, markup.name_ends, max(start, self._name_from))
        if close < 0:
            self._name_from = max(start, len(body) - markup.longest_tag)
            return False
        name = unquoted(body[start:close])
        if not FUNCTION_NAME.fullmatch(name):
            self._not_a_call = True
            return False
        self._name = name
        self._properties = self._schemas.get(name, {})
        self._pos = close  # (the tag that ended the name is read past as text between parameters)
        return True

    def _value_opened(self, body: str, pos: int) -> int:
        """Where the value after a header ending at `pos` starts: past `value_open` and the
        whitespace before it (or the two characters `\\n`, which models write there too); -1
        while the tag may still be coming. A value without the tag starts at `pos`."""
        opener = self._markup.value_open
        if not opener:
            return pos
        at = pos
        while True:
            at = skip_ws(body, at)
            if not body.startswith("\\n", at):
                break
            at += 2
        if body.startswith(opener, at):
            return at + len(opener)
        rest = body[at:]
        coming = rest == "\\" or (len(rest) < len(opener) and opener.startswith(rest))
        return -1 if coming else pos

    def _read_header(self, body: str) -> bool:
        """Read the next parameter's header, up to where its value starts (True), or the
        function's end (the call is done). Searches go on from where the last one stopped."""
        markup = self._markup
        if self._opening < 0:
            opening = _first(body, (markup.parameter,), self._pos)
            closing = _first(body, markup.function_ends, self._pos)
            if closing >= 0 and (opening < 0 or closing < opening):
                self._end_function(body, closing)
                return False
            if opening < 0:
                # Text between parameters is markup's whitespace (or stray text, ignored):
                # read past it, so that it is not searched again as more arrives.
                self._pos = max(self._pos, len(body) - markup.longest_tag)
                return False
            self._opening = self._header_from = opening + len(markup.parameter)
        key_end = _first(body, (markup.header_end,), self._header_from)
        closing = _first(body, markup.function_ends, self._header_from)
        if closing >= 0 and (key_end < 0 or closing < key_end):
            # A header the function's end cut short: no parameter; the function ends there.
            self._end_function(body, closing)
            return False
        if key_end < 0:
            self._header_from = max(self._header_from, len(body) - markup.longest_tag)
            return False
        self._header_from = key_end  # (found again at once while the value's tag comes)
        value_start = self._value_opened(body, key_end + len(markup.header_end))
        if value_start < 0:
            return False
        self._header = body[self._opening:key_end]
        self._value_start = self._search_from = value_start
        self._opening = -1
        return True

    def _read_parameter(self, body: str) -> bool:
        """Read the next parameter (or the function's end) if it is complete; False if not."""
        markup = self._markup
        if self._header is None and not self._read_header(body):
            return False
        # The value ends at its closing tag, or where a model that left the tag out went on.
        end = _first(body, (markup.parameter_end, markup.parameter, *markup.function_ends),
                     self._search_from)
        if end < 0:
            self._search_from = max(self._value_start, len(body) - markup.longest_tag)
            return False
        text = body[self._value_start:end]
        key, value = self._read_value(self._header, text, self._properties)
        try:
            pair = f"{json_text(key)}: {json_text(value)}"
        except (TypeError, ValueError):  # a reader's value with no JSON form: its text
            pair = f"{json_text(key)}: {json_text(text)}"
        self._arguments += pair if self._arguments == "{" else ", " + pair
        self._pos = end + (len(markup.parameter_end)
                           if body.startswith(markup.parameter_end, end) else 0)
        self._header = None
        return True


def _first(text: str, tags: tuple[str, ...], start: int) -> int:
    """Where the first of `tags` occurs in `text` from `start` on; -1 if none does. (Every
    search of a body goes through here: tests count what it reads.)"""
    return min((i for i in (text.find(tag, start) for tag in tags) if i >= 0), default=-1)


def parameter_call_stream(start: str, markup: ParameterMarkup, read_value: ValueReader,
                          tools: list[dict[str, Any]] | None,
                          ignored: tuple[str, ...] = ()) -> ToolCallStream:
    """The stream of a format whose calls sit between `start` and `markup.call_end` (or, where
    it has none, its `function_end`), each parameter in tags of its own, values read by
    `read_value` with `tools`' schemas; `ignored` tags (a block around the calls) vanish."""
    body = ParameterCallBody(markup, read_value, parameter_schemas(tools))
    return TaggedToolStream(start, markup.call_end or markup.function_end, body, ignored,
                            on_new_body=body.restart, end_in_body=True)


class ParameterTagToolParser(ToolParser):
    """A format whose calls sit between `call_start` and its `markup`'s end, each parameter in
    tags of its own, values read by `read_value` with the request's tool schemas; `ignored`
    tags (a block around the calls) vanish."""

    call_start: ClassVar[str]
    markup: ClassVar[ParameterMarkup]
    read_value: ClassVar[ValueReader]
    ignored: ClassVar[tuple[str, ...]] = ()

    def stream(self) -> ToolCallStream:
        return self.stream_for(None)

    def stream_for(self, tools: list[dict[str, Any]] | None) -> ToolCallStream:
        return parameter_call_stream(self.call_start, self.markup, self.read_value, tools,
                                     self.ignored)
