"""Outputs that *are* a sequence of JSON call objects rather than content with tagged calls:
Llama 3's `{"name": ..., "parameters": ...}; {...}` and the `[{"name": ..., "parameters": ...}]`
array that `tool_choice="required"` constrains the model to."""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import CallProgress, ParsedDelta, stream_open_arguments
from ksana_llm.server.tool_parsers.call_list import (
    DROP,
    FIRST_OWN_STATE,
    START,
    CallListStream,
)
from ksana_llm.server.tool_parsers.json_scan import OpenValue, scan_call_object, skip_ws

_OBJECT, _SEPARATOR = range(FIRST_OWN_STATE, FIRST_OWN_STATE + 2)


class JsonCallSequenceStream(CallListStream):
    """`[lead tags] OPEN? {call} (SEP {call})* CLOSE?` -> tool calls; anything else is content.

    The output counts as calls only if its first visible character is `open` (after any `lead`
    tags, which are dropped). An object without a "name" and arguments ("arguments" or
    "parameters") ends the calls: it and everything after it are content. An object that is not
    JSON ends them too: given back as content if its name was never sent, dropped otherwise
    (the call it started was already streamed).
    """

    def __init__(self, *, open: str, separator: str, close: str | None = None,
                 lead: tuple[str, ...] = (), lead_is_text: bool = False,
                 calls_only: bool = False) -> None:
        """`calls_only`: the output was constrained to calls (tool_choice "required"), so an
        unfinished tail means the output was cut off inside one: dropped, never content.
        `lead_is_text`: see `OutputStart`."""
        super().__init__(lead, lead_is_text)
        self._open = open
        self._calls_only = calls_only
        self._separator = separator
        self._close = close
        self._call: CallProgress | None = None
        self._name: str | None = None  # the open call's name, once known
        self._open_value: OpenValue | None = None  # the open object's unfinished value

    def _open_at(self, pos: int) -> None:
        if self._text.startswith(self._open, pos):
            self._pos = pos + (0 if self._open == "{" else len(self._open))
            self._state = _OBJECT
        else:
            self._to_content(pos)

    def _read_calls(self, out: ParsedDelta) -> bool:
        text, pos = self._text, self._pos
        if self._state == _OBJECT:
            i = skip_ws(text, pos)
            if i >= len(text):
                return False
            if text[i] != "{":
                if self._close is not None and text[i] == self._close:
                    self._pos = i
                    self._state = _SEPARATOR
                else:
                    self._to_content(i)
                return True
            if self._open_value is not None and not self._open_value.advance(text):
                # Inside a long value: only the new text is read (see OpenValue).
                stream_open_arguments(out, self._call, self._name, text, self._open_value)
                return False
            scan = scan_call_object(text, i)
            open_at = scan.open_at
            self._open_value = None if open_at is None else OpenValue(
                text, open_at, is_arguments=open_at == scan.args_start)
            # A call needs its arguments too: `{"name": "John", "age": 30}` is an answer.
            if scan.name is not None and scan.args_start is not None:
                self._name = scan.name
                if self._call is None:
                    self._call = CallProgress(self._num_calls)
                    self._num_calls += 1
                    self._gate.had_call = True
                delta = self._call.update(scan.name, scan.arguments(text))
                if delta is not None:
                    out.tool_calls.append(delta)
            if scan.invalid:
                if self._call is not None:
                    self._state = DROP
                else:
                    self._to_content(i)
                self._call = None
                self._open_value = None
                return True
            if scan.end is None:
                self._pos = i  # rescan from the object's start when more text comes
                return False
            if self._call is None:  # a complete object without a name: not a call
                self._to_content(i)
                return True
            closing = self._call.close()
            if closing is not None:
                out.tool_calls.append(closing)
            self._call = None
            self._name = None
            self._pos = scan.end
            self._state = _SEPARATOR
            return True
        # _SEPARATOR: after an object (or after `close`, where only whitespace may follow)
        i = skip_ws(text, pos)
        if i >= len(text):
            return False
        if text[i] == self._separator:
            self._pos = i + 1
            self._state = _OBJECT
        elif self._close is not None and text[i] == self._close:
            self._to_content(i + 1)  # closed: whatever follows is content, a separator too
        else:
            self._to_content(i)
        return True

    def _named_call_cut_short(self, out: ParsedDelta) -> None:
        if self._state != _OBJECT:
            return
        scan = scan_call_object(self._text, skip_ws(self._text, self._pos))
        if scan.name is None:
            return
        call = CallProgress(self._num_calls)
        self._num_calls += 1
        # Not closed: its arguments never came, and "{}" would read as a call that takes none.
        delta = call.update(scan.name, "")
        if delta is not None:
            out.tool_calls.append(delta)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._calls_only and self._state in (START, _OBJECT) and self._call is None:
            # Cut off before a call's arguments: a call whose name came is still a call.
            self._named_call_cut_short(out)
        elif self._state == START:
            self._finish_undecided(out)
        elif self._state == _OBJECT and self._call is None:
            # Cut off inside an object whose name never came: content after all.
            self._to_content(self._pos)
            self._advance(out)
        elif self._call is not None:  # cut off inside a call
            closing = self._call.close()
            if closing is not None:
                out.tool_calls.append(closing)
        self._pos = len(self._text)
        out.content += self._gate.finish()
        return out
