"""Outputs that *are* a sequence of JSON call objects rather than content with tagged calls:
Llama 3's `{"name": ..., "parameters": ...}; {...}` and the `[{"name": ..., "parameters": ...}]`
array that `tool_choice="required"` constrains the model to."""

from __future__ import annotations

from ksana_llm.server.tool_parsers.base import (
    CallProgress,
    ContentGate,
    ParsedDelta,
    ToolCallStream,
    held_prefix,
    stream_open_arguments,
)
from ksana_llm.server.tool_parsers.json_scan import OpenValue, scan_call_object, skip_ws

_START, _OBJECT, _SEPARATOR, _CONTENT, _DROP = range(5)


class JsonCallSequenceStream(ToolCallStream):
    """`[lead tags] OPEN? {call} (SEP {call})* CLOSE?` -> tool calls; anything else is content.

    The output counts as calls only if its first visible character is `open` (after any `lead`
    tags, which are dropped). An object without a "name" and arguments ("arguments" or
    "parameters") ends the calls: it and everything after it are content. An object that is not JSON ends them too: given back as content if its name
    was never sent, dropped otherwise (the call it started was already streamed).
    """

    def __init__(self, *, open: str, separator: str, close: str | None = None,
                 lead: tuple[str, ...] = (), calls_only: bool = False) -> None:
        """`calls_only`: the output was constrained to calls (tool_choice "required"), so an
        unfinished tail means the output was cut off inside one: dropped, never content."""
        self._open = open
        self._calls_only = calls_only
        self._separator = separator
        self._close = close
        self._lead = lead
        self._state = _START
        self._text = ""  # everything received
        self._pos = 0  # where the undecided text starts
        self._prefix = ""  # leading whitespace of the output, content if it turns out to be content
        self._region = 0  # where the calls start (after the lead tags)
        self._call: CallProgress | None = None
        self._name: str | None = None  # the open call's name, once known
        self._open_value: OpenValue | None = None  # the open object's unfinished value
        self._num_calls = 0
        self._gate = ContentGate()

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        out = ParsedDelta()
        self._advance(out)
        return out

    def _advance(self, out: ParsedDelta) -> None:
        while True:
            text, pos = self._text, self._pos
            if self._state == _CONTENT:
                out.content += self._gate.push(text[pos:])
                self._pos = len(text)
                return
            if self._state == _DROP:
                self._pos = len(text)
                return
            if self._state == _START:
                i = skip_ws(text, pos)
                self._prefix += text[pos:i]
                self._pos = i
                rest = text[i:]
                tag = next((t for t in self._lead if rest.startswith(t)), None)
                if tag is not None:
                    self._pos = i + len(tag)
                    continue
                if not rest or (held_prefix(rest, self._lead) == len(rest)):
                    return  # undecided: more whitespace, or a lead tag being spelled out
                self._region = i
                if rest.startswith(self._open):
                    self._pos = i + (0 if self._open == "{" else len(self._open))
                    self._state = _OBJECT
                else:
                    self._to_content(i)
                continue
            if self._state == _OBJECT:
                i = skip_ws(text, pos)
                if i >= len(text):
                    return
                if text[i] != "{":
                    if self._close is not None and text[i] == self._close:
                        self._pos = i
                        self._state = _SEPARATOR
                    else:
                        self._to_content(i)
                    continue
                if self._open_value is not None and not self._open_value.advance(text):
                    # Inside a long value: only the new text is read (see OpenValue).
                    stream_open_arguments(out, self._call, self._name, text, self._open_value)
                    return
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
                        self._state = _DROP
                    else:
                        self._to_content(i)
                    self._call = None
                    self._open_value = None
                    continue
                if scan.end is None:
                    self._pos = i  # rescan from the object's start when more text comes
                    return
                if self._call is None:  # a complete object without a name: not a call
                    self._to_content(i)
                    continue
                closing = self._call.close()
                if closing is not None:
                    out.tool_calls.append(closing)
                self._call = None
                self._name = None
                self._pos = scan.end
                self._state = _SEPARATOR
                continue
            # _SEPARATOR: after an object (or after `close`, where only whitespace may follow)
            i = skip_ws(text, pos)
            if i >= len(text):
                return
            if text[i] == self._separator:
                self._pos = i + 1
                self._state = _OBJECT
            elif self._close is not None and text[i] == self._close:
                self._pos = i + 1
                self._close = None  # closed: whatever follows is content
            else:
                self._to_content(i)

    def _to_content(self, pos: int) -> None:
        """Everything from `pos` on is content; before any call, the whole output is (less the
        lead tags), so a plain answer passes through unchanged."""
        self._state = _CONTENT
        if self._num_calls == 0:
            self._gate.push(self._prefix)  # held by the gate until visible text follows
            self._pos = self._region
        else:
            self._pos = pos

    def _named_call_cut_short(self, out: ParsedDelta) -> None:
        if self._state != _OBJECT:
            return
        scan = scan_call_object(self._text, skip_ws(self._text, self._pos))
        if scan.name is None:
            return
        call = CallProgress(self._num_calls)
        self._num_calls += 1
        for delta in (call.update(scan.name, ""), call.close()):
            if delta is not None:
                out.tool_calls.append(delta)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._calls_only and self._state in (_START, _OBJECT) and self._call is None:
            # Cut off before a call's arguments: a call whose name came is still a call.
            self._named_call_cut_short(out)
        elif self._state == _START:
            # Never decided: whitespace (and maybe half a lead tag) is content.
            out.content += self._gate.push(self._prefix + self._text[self._pos:])
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
