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
NOT_A_CALL = -1  # (CallExtent.read)
_JSON_NAMES = {"null": None, "true": True, "false": False}


class _JsonNames(ast.NodeTransformer):
    """JSON's `null`, `true` and `false` written as Python names, made the constants they mean
    (models shown their tools' JSON schemas write them so)."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node


def python_call(source: str, json_names: bool = False) -> ToolCall | None:
    """`name(key=literal, ...)` as a call with JSON arguments; None if `source` is not that.
    `json_names`: `null`, `true` and `false` are literals too (Olmo 3 writes them)."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if json_names:
            node = _JsonNames().visit(node)
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


class CallExtent:
    """Where one call, `name(...)` from its first character at `start`, ends, read as its text
    arrives: strings (any quotes, escapes, triple quotes) and bracket depth tell, and each
    character is read once however finely the text streams."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start  # read up to here
        self._depth = 0
        self._quote: str | None = None  # the open string literal's quote
        self._in_name = True  # before the call's "("

    def read(self, text: str) -> int | None:
        """Read on in `text`: where the call ends (past its `)`) once it does, None while more
        text is needed, NOT_A_CALL once it is clear that none is there."""
        pos = self._pos
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
            if self._in_name:
                # A call opens with its name: any other text (`[Don't worry]`) is no call, and
                # is known as such at once rather than read as an open string to the end.
                if c == "(":
                    self._in_name = False
                elif not (c.isalnum() or c == "_" or c in WHITESPACE):
                    return NOT_A_CALL
            elif c in "'\"":
                ahead = text[pos:pos + 3]
                if len(ahead) < 3 and ahead == c * len(ahead):
                    break  # a triple quote or not: the next characters tell
                self._quote = c * 3 if ahead == c * 3 else c
                pos += len(self._quote)
                continue
            if c in "([{":
                self._depth += 1
            elif c in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    return pos + 1 if c == ")" else NOT_A_CALL
            pos += 1
        self._pos = pos
        return None


class PythonicCallStream(CallListStream):
    """The list is scanned once, as it arrives: strings (any quotes) and bracket depth tell
    where each call ends, and only then is the call parsed."""

    def __init__(self) -> None:
        super().__init__((PYTHON_START,))
        self._call: CallExtent | None = None  # the call being read
        self._comma_due = False  # a call ended: a comma (or the list's end) comes next

    def _open_at(self, pos: int) -> None:
        if self._text[pos] == "[":
            self._pos, self._state = pos + 1, _LIST
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
        while True:
            if self._call is not None:
                end = self._call.read(text)
                if end is None:
                    self._pos = pos
                    return False
                call = None if end == NOT_A_CALL else python_call(text[self._call.start:end])
                if call is None:
                    return self._not_a_call()
                self._send(out, call)
                pos = end
                continue
            if pos >= len(text):
                self._pos = pos
                return False
            c = text[pos]
            if c in WHITESPACE:
                pos += 1
            elif c == "," and self._comma_due:
                self._comma_due = False
                pos += 1
            elif c == "]":  # (after a call, or after a trailing comma, as Python allows)
                self._pos = pos + 1
                if self._num_calls == 0:  # an empty list: an answer, not calls
                    self._to_content(self._pos)
                else:
                    self._state = _AFTER
                return True
            elif self._comma_due or not (c.isalpha() or c == "_"):
                return self._not_a_call()  # (a bare value in the list: `[1, 2]`)
            else:
                self._call = CallExtent(pos)

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
        self._call = None
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
