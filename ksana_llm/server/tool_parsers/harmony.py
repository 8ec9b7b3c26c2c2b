"""OpenAI's harmony format (GPT-OSS), read from the output text with its special tokens kept.

An answer is a run of messages, each a header, `<|message|>`, a body, and a terminator:

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>

The channel says what a body is: `analysis` the chain of thought, `final` the answer,
`commentary` a preamble or, with a recipient (`to=functions.NAME`), a tool call whose body is
its JSON arguments. `HarmonyMessages` splits the text into events as it streams -- a message
opens (its header complete), body text, a message closes -- holding back only what may be half
of a special token. Text that does not begin with a header (a model not writing harmony) is a
headerless message of plain text, until a header starts. The reasoning parser `openai_gptoss`
and the tool-call parser `openai` are both this machine, routed differently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ksana_llm.server.tool_parsers.base import held_prefix

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
_TERMINATORS = (END, RETURN, CALL)
_OPENERS = (START, CHANNEL)
_ALL_TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_WHITESPACE = " \t\r\n"
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
# A header's parts, each optional: a role, a channel, a recipient, a constraint.
_HEADER_ONLY = re.compile(r"(<\|start\|>\s*\w*)?(\s*to=[^\s<]*)?\s*(<\|channel\|>\s*\w*)?"
                          r"(\s*to=[^\s<]*)?(\s*<\|constrain\|>)?(\s*\w+)?\s*")
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
    kind: Literal["open", "text", "close"]
    message: HarmonyMessage
    text: str = ""


def _header(text: str, number: int) -> HarmonyMessage:
    channel = _CHANNEL_NAME.search(text)
    recipient = _RECIPIENT.search(text)
    return HarmonyMessage(number, channel.group(1) if channel else None,
                          recipient.group(1) if recipient else None)


class HarmonyMessages:
    """The incremental splitter: `feed` text as it comes, then `finish`.

    Nothing the model wrote is lost, however it strays from the format: a header closed by a
    terminator before any `<|message|>` is plain text (its special tokens taken out), a header
    starting inside a body ends that body, and terminators in plain text are dropped. Only a
    header the output was cut off in (max_tokens) says nothing and is dropped."""

    def __init__(self) -> None:
        self._buffer = ""
        self._message: HarmonyMessage | None = None  # the open message
        self._plain = False  # the open message is plain text (no harmony header)
        self._count = 0

    def _open(self, message: HarmonyMessage, out: list[HarmonyEvent], plain: bool) -> None:
        self._message, self._plain = message, plain
        self._count += 1
        out.append(HarmonyEvent("open", message))

    def _close(self, out: list[HarmonyEvent]) -> None:
        out.append(HarmonyEvent("close", self._message))
        self._message = None

    def _text(self, text: str, out: list[HarmonyEvent]) -> None:
        if text:
            out.append(HarmonyEvent("text", self._message, text))

    def feed(self, text: str) -> list[HarmonyEvent]:
        self._buffer += text
        out: list[HarmonyEvent] = []
        while self._buffer and (self._between(out) if self._message is None
                                else self._in_body(out)):
            pass
        return out

    def _between(self, out: list[HarmonyEvent]) -> bool:
        """Between messages: a header, or plain text. False: wait for more text."""
        visible = self._buffer.lstrip(_WHITESPACE)
        if not visible:
            return False
        if not any(visible.startswith(tag) or tag.startswith(visible) for tag in _OPENERS):
            self._buffer = visible
            self._open(HarmonyMessage(self._count), out, plain=True)
            return True
        body = visible.find(MESSAGE)
        end, tag = _first(visible, _TERMINATORS)
        if body >= 0 and (end < 0 or body < end):
            self._buffer = visible[body + len(MESSAGE):]
            self._open(_header(visible[:body], self._count), out, plain=False)
            return True
        if end < 0:
            return False  # the header is still being written
        # A header closed with no body: what it says is plain text.
        self._buffer = visible[end + len(tag):]
        self._open(HarmonyMessage(self._count), out, plain=True)
        self._text(untagged(visible[:end]).strip(_WHITESPACE), out)
        self._close(out)
        return True

    def _in_body(self, out: list[HarmonyEvent]) -> bool:
        """In a body: text up to its terminator, or up to a header that starts (which ends it
        too). Plain text drops terminators and runs on."""
        at, tag = _first(self._buffer, _TERMINATORS + _OPENERS)
        if at < 0:
            cut = len(self._buffer) - held_prefix(self._buffer, _TERMINATORS + _OPENERS)
            self._text(self._buffer[:cut], out)
            self._buffer = self._buffer[cut:]
            return False
        self._text(self._buffer[:at], out)
        if tag in _TERMINATORS:
            self._buffer = self._buffer[at + len(tag):]
            if self._plain:
                return True
        else:
            self._buffer = self._buffer[at:]  # the next header's
        self._close(out)
        return True

    def finish(self) -> list[HarmonyEvent]:
        """The rest: an open message's held-back text, then its close; text left between
        messages as plain text, unless it is only a header cut short."""
        out: list[HarmonyEvent] = []
        rest, self._buffer = self._buffer, ""
        if self._message is None:
            rest = rest.strip(_WHITESPACE)
            if rest and not _cut_header(rest):
                self._open(HarmonyMessage(self._count), out, plain=True)
                self._text(untagged(rest).strip(_WHITESPACE), out)
                self._close(out)
            return out
        self._text(rest, out)
        self._close(out)
        return out


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of `tags` in `text`: (index, tag), or (-1, "")."""
    found = [(i, tag) for tag in tags if (i := text.find(tag)) >= 0]
    return min(found) if found else (-1, "")


def untagged(text: str) -> str:
    """`text` with harmony's special tokens taken out."""
    for tag in _ALL_TAGS:
        text = text.replace(tag, "")
    return text


def _cut_header(text: str) -> bool:
    """Whether `text` is the start of a header and nothing more (the output ended in it)."""
    text = text[:len(text) - held_prefix(text, _ALL_TAGS)]
    return _HEADER_ONLY.fullmatch(text) is not None


def harmony_header(message: HarmonyMessage) -> str:
    """A message's header as harmony writes it (what a reader downstream parses again)."""
    header = f"{CHANNEL}{message.channel or 'commentary'}"
    if message.recipient is not None:
        header += f" to={message.recipient}"
    return header + MESSAGE
