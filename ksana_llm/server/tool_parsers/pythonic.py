"""Pythonic tool calls (vLLM's `pythonic` and `llama4_pythonic`: Llama 3.2 and Llama 4's
templates, ToolACE): the whole answer is a Python list of calls with keyword arguments,
`[get_weather(city="Paris", days=3), get_time()]`, optionally after Llama 4's
`<|python_start|>` and before its `<|python_end|>` (in the text only when special tokens are
not skipped). An answer that does not open with `[`, or whose list holds no call, is content.

Argument values are Python literals, turned into JSON when the call's closing parenthesis
arrives, so each call is streamed whole then (JSON formats stream their arguments as written).
A call that is not one (positional arguments, a value that is not a literal or has no JSON
form) ends the calls: before any call the whole answer is content; after one, the rest is
dropped (the calls before it were already sent).
"""

from __future__ import annotations

import ast

from ksana_llm.server.tool_parsers.base import (
    FUNCTION_NAME,
    CallProgress,
    ParsedDelta,
    ToolCall,
    ToolCallStream,
    ToolParser,
    held_prefix,
    json_text,
)
from ksana_llm.server.tool_parsers.call_list import (
    CONTENT,
    DROP,
    FIRST_OWN_STATE,
    START,
    CallListStream,
)
from ksana_llm.server.tool_parsers.json_scan import WHITESPACE, skip_ws

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"

_LIST, _AFTER = range(FIRST_OWN_STATE, FIRST_OWN_STATE + 2)


def python_call(source: str) -> ToolCall | None:
    """`name(key=literal, ...)` as a call with JSON arguments; None if `source` is not that."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
            or not FUNCTION_NAME.fullmatch(node.func.id):
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **mapping
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        text = json_text(arguments)
    except (TypeError, ValueError):  # a set, bytes, a complex number, NaN: no JSON for it
        return None
    return ToolCall(node.func.id, text)


class PythonicCallStream(CallListStream):
    """The list is scanned once, as it arrives: strings (any quotes) and bracket depth tell
    where each call ends, and only then is the call parsed."""

    def __init__(self) -> None:
        super().__init__((PYTHON_START,))
        self._depth = 0  # bracket depth; 1 between the list's calls
        self._quote: str | None = None  # the open string literal's quote
        self._call_start: int | None = None
        self._comma_due = False  # a call ended: a comma (or the list's end) comes next
        self._in_name = False  # between a call's first character and its "("

    def _open_at(self, pos: int) -> None:
        if self._text[pos] == "[":
            self._pos, self._depth, self._state = pos + 1, 1, _LIST
        else:
            self._to_content(pos)

    def _read_calls(self, out: ParsedDelta) -> bool:
        if self._state == _LIST:
            return self._scan_list(out)
        # _AFTER: the list closed; what follows is content, less Llama 4's end tag.
        start = skip_ws(self._text, self._pos)
        rest = self._text[start:]
        if held_prefix(rest, (PYTHON_END,)) == len(rest):
            return False  # nothing yet, or maybe <|python_end|> being spelled out
        if rest.startswith(PYTHON_END):
            self._pos = start + len(PYTHON_END)
        self._state = CONTENT
        return True

    def _scan_list(self, out: ParsedDelta) -> bool:
        """Scan the list on from `_pos`; True when the state changed (False: more text needed)."""
        text, pos = self._text, self._pos
        while pos < len(text):
            c = text[pos]
            if self._quote is not None:
                if c == "\\":
                    if pos + 1 >= len(text):
                        break
                    pos += 2
                elif text.startswith(self._quote, pos):
                    pos += len(self._quote)
                    self._quote = None
                elif len(self._quote) == 3 and self._quote.startswith(text[pos:]):
                    break  # maybe the closing triple quote, half written
                else:
                    pos += 1
                continue
            if c in "'\"":
                ahead = text[pos:pos + 3]
                if len(ahead) < 3 and ahead == c * len(ahead):
                    break  # a triple quote or not: the next characters tell
                self._quote = c * 3 if ahead == c * 3 else c
                pos += len(self._quote)
                continue
            if self._depth == 1 and self._call_start is None:
                if c in WHITESPACE:
                    pos += 1
                    continue
                if c == "," and self._comma_due:
                    self._comma_due = False
                    pos += 1
                    continue
                if c == "]":  # (after a call, or after a trailing comma, as Python allows)
                    self._pos = pos + 1
                    if self._num_calls == 0:  # an empty list: an answer, not calls
                        self._to_content(self._pos)
                    else:
                        self._state = _AFTER
                    return True
                if self._comma_due or not (c.isalpha() or c == "_"):
                    return self._not_a_call()
                self._call_start = pos
                self._in_name = True
            if self._in_name:
                # A call opens with its name: any other text (`[Don't worry]`) is no call, and
                # is known as such at once rather than read as an open string to the end.
                if c == "(":
                    self._in_name = False
                elif not (c.isalnum() or c == "_" or c in WHITESPACE):
                    return self._not_a_call()
            if c in "([{":
                self._depth += 1
            elif c in ")]}":
                self._depth -= 1
                if self._depth < 1:
                    return self._not_a_call()
                if self._depth == 1:
                    if c != ")":
                        return self._not_a_call()
                    call = python_call(text[self._call_start:pos + 1])
                    if call is None:
                        return self._not_a_call()
                    self._send(out, call)
            elif self._depth == 1 and c == ",":
                return self._not_a_call()  # a bare value in the list (`[1, 2]`)
            pos += 1
        self._pos = pos
        return False

    def _send(self, out: ParsedDelta, call: ToolCall) -> None:
        progress = CallProgress(self._num_calls)
        self._num_calls += 1
        self._gate.had_call = True
        delta = progress.update(call.name, call.arguments)
        if delta is not None:
            out.tool_calls.append(delta)
        closing = progress.close()
        if closing is not None:
            out.tool_calls.append(closing)
        self._call_start = None
        self._comma_due = True

    def _not_a_call(self) -> bool:
        if self._num_calls == 0:
            self._to_content(self._pos)
        else:
            self._state = DROP
        return True

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == START:
            self._finish_undecided(out)
        elif self._state == _LIST and self._num_calls == 0:
            # The list never held a call: the output was an answer after all.
            self._to_content(self._pos)
            self._advance(out)
        elif self._state == _AFTER:
            # A tail of text that only looked like the start of <|python_end|>.
            out.content += self._gate.push(self._text[self._pos:])
        # _LIST after calls: cut off inside the next call, which was never sent.
        self._pos = len(self._text)
        out.content += self._gate.finish()
        return out


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def stream(self) -> ToolCallStream:
        return PythonicCallStream()


class Llama4PythonicToolParser(PythonicToolParser):
    """Llama 4's template asks for the pythonic list (between its python tags)."""

    name = "llama4_pythonic"
