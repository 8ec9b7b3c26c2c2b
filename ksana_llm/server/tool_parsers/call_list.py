"""Outputs that are either all calls or plain content, decided by how they open: Llama 3's
`{...}; {...}`, the `[{...}]` array of tool_choice "required", Granite's, the pythonic
`[f(a=1)]`. The shared part: leading whitespace and lead tags, the switch to content, and
dropping what follows a broken call."""

from __future__ import annotations

from abc import abstractmethod

from ksana_llm.server.tool_parsers.base import ContentGate, OutputStart, ParsedDelta, ToolCallStream

START, CONTENT, DROP = range(3)
FIRST_OWN_STATE = 3  # subclasses number their states from here


class CallListStream(ToolCallStream):
    """The output counts as calls only if its first visible text (after whitespace and `lead`
    tags, which are dropped) opens them (`_open_at`); otherwise all of it is content, unchanged.
    Subclasses read the calls in states of their own (`_read_calls`)."""

    def __init__(self, lead: tuple[str, ...], lead_is_text: bool = False) -> None:
        self._start = OutputStart(lead, lead_is_text=lead_is_text)
        self._state = START
        self._text = ""  # everything received
        self._pos = 0  # where the undecided text starts
        self._region = 0  # where the calls start (after the lead tags)
        self._num_calls = 0
        self._gate = ContentGate()
        self._lead_text = ""  # the start's text, to send with the content (`lead_is_text`)

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        out = ParsedDelta()
        self._advance(out)
        return out

    def _advance(self, out: ParsedDelta) -> None:
        while True:
            if self._state == CONTENT:
                out.content += self._lead_text + self._gate.push(self._text[self._pos:])
                self._lead_text = ""
                self._pos = len(self._text)
                return
            if self._state == DROP:
                self._pos = len(self._text)
                return
            if self._state == START:
                i, decided = self._start.scan(self._text, self._pos)
                self._pos = i
                if not decided:
                    return
                self._region = i
                self._open_at(i)
            elif not self._read_calls(out):
                return

    @abstractmethod
    def _open_at(self, pos: int) -> None:
        """The first visible text starts at `pos`: enter a state that reads calls from there,
        or `_to_content`."""

    @abstractmethod
    def _read_calls(self, out: ParsedDelta) -> bool:
        """Read on in one of the subclass's states, adding to `out`; False when it needs more
        text, True when the state changed (read on)."""

    def _to_content(self, pos: int) -> None:
        """Everything from `pos` on is content; before any call, the whole output is (less the
        lead tags), so a plain answer passes through unchanged."""
        self._state = CONTENT
        if self._num_calls == 0:
            # Whitespace is held by the gate until visible text follows; a lead that is text
            # goes out at once.
            self._lead_text = self._gate.push(self._start.prefix)
            self._pos = self._region
        else:
            self._pos = pos

    def _finish_undecided(self, out: ParsedDelta) -> None:
        """The output ended before its first visible text decided it: whitespace (and maybe
        half a lead tag) is content."""
        out.content += self._gate.push(self._start.prefix + self._text[self._pos:])
