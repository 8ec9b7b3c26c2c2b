"""OpenAI's harmony format (GPT-OSS), read from the output text with its special tokens kept.

An answer is a run of messages, each a header, `<|message|>`, a body, and a terminator:

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>

The channel says what a body is: `analysis` the chain of thought, `final` the answer,
`commentary` a preamble or, with a recipient (`to=functions.NAME`), a tool call whose body is
its JSON arguments. `HarmonyMessages` splits the text into events as it streams -- a message
opens (its header complete), body text, a message closes -- holding back only what may be half
of a special token. Text that does not begin with a header (a model not writing harmony) is one
headerless message of plain text (until a header starts). The reasoning parser `openai_gptoss` and the tool-call parser
`openai` are both this machine, routed differently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ksana_llm.server.tool_parsers.base import held_prefix

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
_TERMINATORS = (END, RETURN, CALL)
_HEADER_OPENERS = (START, CHANNEL)
_WHITESPACE = " \t\r\n"
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."


@dataclass(frozen=True)
class HarmonyMessage:
    """One message's header: its channel and recipient (None when not given); a headerless
    message (plain text) has neither. `number` counts the messages of one output from 0."""

    number: int
    channel: str | None = None
    recipient: str | None = None

    @property
    def function(self) -> str | None:
        """The function a tool-call message calls (`to=functions.NAME`), else None."""
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS):] or None
        return None


@dataclass(frozen=True)
class HarmonyEvent:
    kind: str  # "open" | "text" | "close"
    message: HarmonyMessage
    text: str = ""


def _header(text: str, number: int) -> HarmonyMessage:
    channel = _CHANNEL_NAME.search(text)
    recipient = _RECIPIENT.search(text)
    return HarmonyMessage(number, channel.group(1) if channel else None,
                          recipient.group(1) if recipient else None)


class HarmonyMessages:
    """The incremental splitter: `feed` text as it comes, then `finish`."""

    def __init__(self) -> None:
        self._buffer = ""
        self._message: HarmonyMessage | None = None  # the open message
        self._plain = False  # the rest of the output is plain text (no harmony header came)
        self._count = 0

    def _open(self, message: HarmonyMessage, out: list[HarmonyEvent]) -> None:
        self._message = message
        self._count += 1
        out.append(HarmonyEvent("open", message))

    def feed(self, text: str) -> list[HarmonyEvent]:
        self._buffer += text
        out: list[HarmonyEvent] = []
        while self._buffer:
            if self._message is None:  # between messages: a header, or plain text
                visible = self._buffer.lstrip(_WHITESPACE)
                if not visible:
                    return out
                if not any(visible.startswith(tag) or tag.startswith(visible)
                           for tag in _HEADER_OPENERS):
                    self._plain = True
                    self._buffer = visible
                    self._open(HarmonyMessage(self._count), out)
                    continue
                end = visible.find(MESSAGE)
                if end < 0:
                    return out  # the header is still being written
                self._buffer = visible[end + len(MESSAGE):]
                self._open(_header(visible[:end], self._count), out)
            elif self._plain:  # plain text, until a header starts (harmony after all)
                starts = [i for i in (self._buffer.find(tag) for tag in _HEADER_OPENERS)
                          if i >= 0]
                cut = min(starts) if starts else \
                    len(self._buffer) - held_prefix(self._buffer, _HEADER_OPENERS)
                if cut:
                    out.append(HarmonyEvent("text", self._message, self._buffer[:cut]))
                self._buffer = self._buffer[cut:]
                if not starts:
                    return out
                out.append(HarmonyEvent("close", self._message))
                self._message, self._plain = None, False
            else:
                ends = [i for i in (self._buffer.find(tag) for tag in _TERMINATORS) if i >= 0]
                if not ends:
                    cut = len(self._buffer) - held_prefix(self._buffer, _TERMINATORS)
                    if cut:
                        out.append(HarmonyEvent("text", self._message, self._buffer[:cut]))
                    self._buffer = self._buffer[cut:]
                    return out
                end = min(ends)
                if end:
                    out.append(HarmonyEvent("text", self._message, self._buffer[:end]))
                tag = next(t for t in _TERMINATORS if self._buffer.startswith(t, end))
                self._buffer = self._buffer[end + len(tag):]
                out.append(HarmonyEvent("close", self._message))
                self._message = None
        return out

    def finish(self) -> list[HarmonyEvent]:
        """The rest: an open message's held-back text, then its close. An unfinished header
        (the output cut off inside one) says nothing and is dropped."""
        out: list[HarmonyEvent] = []
        rest, self._buffer = self._buffer, ""
        if self._message is not None:
            if rest:
                out.append(HarmonyEvent("text", self._message, rest))
            out.append(HarmonyEvent("close", self._message))
            self._message = None
        return out


def harmony_header(message: HarmonyMessage) -> str:
    """A message's header as harmony writes it (what a reader downstream parses again)."""
    header = f"{CHANNEL}{message.channel or 'commentary'}"
    if message.recipient is not None:
        header += f" to={message.recipient}"
    return header + MESSAGE
