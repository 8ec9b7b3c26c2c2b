"""A Responses answer as output items and OpenAI's typed stream events.

`OutputItems` turns the parsed deltas of the one choice (reasoning, text, tool calls, see
`server.chat_output`) into `reasoning`, `message` and `function_call` items and the events
that stream them (`response.output_item.added`, `response.output_text.delta`, ...), numbered by
`SseEvents`. The non-streamed answer is built by the same code, so both agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ksana_llm.server.chat_output import ChatDelta, ChoiceOutputParser
from ksana_llm.server.responses_protocol import (
    function_call_item,
    item_id,
    message_item,
    reasoning_item,
    text_part,
)


class SseEvents:
    """SSE framing with OpenAI's event names and a running `sequence_number`."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


@dataclass
class OpenItem:
    kind: str  # "reasoning" | "message" | "function_call"
    index: int  # its output_index
    id: str
    text: str = ""  # reasoning or message text, or a call's arguments
    call_index: int = -1  # a function call's index in the parser's calls
    call_id: str = ""
    name: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class OutputItems:
    """Parsed deltas of the one choice -> output items and their events, in the order the text
    gives them: an item opens with its first text and closes when another starts (or the
    answer ends). The non-streamed answer is built by the same code from the whole text in one
    delta, so both agree, but for text after a tool call: a parser hands one delta's text over
    in one piece, so in one piece that text joins the message before the calls, as in the chat
    route's message.

    Logprobs go with the message text: those of tokens before any text wait for the next text
    delta (end-of-turn tokens join the message when it closes). Whitespace a tool parser leaves
    between or after calls opens no message."""

    def __init__(self, events: SseEvents, parser: ChoiceOutputParser) -> None:
        self.ev = events
        self.parser = parser
        self.output: list[dict[str, Any]] = []
        self.open: OpenItem | None = None
        self.pending_logprobs: list[dict[str, Any]] = []
        self.message: OpenItem | None = None
        self._after_call = False  # the last item started is a function call
        self._held_space = ""

    def add(self, delta: ChatDelta, logprobs: list[dict[str, Any]]) -> Iterator[str]:
        """Events for one parsed delta. Its parts are taken in the order the text can have
        them: reasoning, the rest of the call already open, text, then new calls.

        A message's logprobs are its text's tokens': those of a delta that is all reasoning or
        calls are dropped, with the ones before it that made no text (a `<think>` tag), and so
        are those of text-less tokens that follow reasoning or a call (`</think>`, blank lines)."""
        closing = not delta and self.open is not None and self.open.kind != "message"
        if (delta.reasoning or delta.tool_calls) and not delta.content:
            self.pending_logprobs.clear()
        elif not closing:
            self.pending_logprobs.extend(logprobs)
        if delta.reasoning:
            if self.open is None or self.open.kind != "reasoning":
                yield from self._start(OpenItem("reasoning", len(self.output), item_id("rs")))
            self.open.text += delta.reasoning
            yield self.ev("response.reasoning_text.delta", item_id=self.open.id,
                          output_index=self.open.index, content_index=0, delta=delta.reasoning)
        calls = list(delta.tool_calls)
        while calls and calls[0].name is None and self._open_call(calls[0].index):
            yield from self._arguments(calls.pop(0).arguments)
        if delta.content:
            yield from self._text(delta.content)
        for call in calls:
            if call.name is not None:
                yield from self._start(OpenItem(
                    "function_call", len(self.output), item_id("fc"), call_index=call.index,
                    call_id=self.parser.call_id(call.index), name=call.name))
                self._after_call, self._held_space = True, ""
            if self._open_call(call.index):
                yield from self._arguments(call.arguments)

    def _open_call(self, index: int) -> bool:
        return self.open is not None and self.open.kind == "function_call" \
            and self.open.call_index == index

    def _arguments(self, text: str) -> Iterator[str]:
        if text:
            self.open.text += text
            yield self.ev("response.function_call_arguments.delta", item_id=self.open.id,
                          output_index=self.open.index, delta=text)

    def _text(self, text: str) -> Iterator[str]:
        if self._after_call:
            self._held_space += text
            if not self._held_space.strip():
                return
            text, self._held_space, self._after_call = self._held_space, "", False
        if self.open is None or self.open.kind != "message":
            yield from self.start_message()
        lp, self.pending_logprobs = self.pending_logprobs, []
        self.open.text += text
        self.open.logprobs.extend(lp)
        yield self.ev("response.output_text.delta", item_id=self.open.id,
                      output_index=self.open.index, content_index=0, delta=text, logprobs=lp)

    def start_message(self) -> Iterator[str]:
        yield from self._start(OpenItem("message", len(self.output), item_id("msg")))
        self.message = self.open

    def finish(self, status: str) -> Iterator[str]:
        """Close the answer: an answer that said nothing is one empty message."""
        if not self.output:
            yield from self.start_message()
        yield from self.close(status)

    def _start(self, item: OpenItem) -> Iterator[str]:
        yield from self.close("completed")
        self.open = item
        self.output.append({})  # its slot; filled when it closes
        yield self.ev("response.output_item.added", output_index=item.index,
                      item=self._item(item, "in_progress", whole=False))
        if item.kind == "reasoning":
            yield self.ev("response.content_part.added", item_id=item.id,
                          output_index=item.index, content_index=0,
                          part={"type": "reasoning_text", "text": ""})
        elif item.kind == "message":
            yield self.ev("response.content_part.added", item_id=item.id,
                          output_index=item.index, content_index=0, part=text_part(""))

    @staticmethod
    def _item(item: OpenItem, status: str, whole: bool = True) -> dict[str, Any]:
        if item.kind == "reasoning":
            return reasoning_item(item.text if whole else "", status, item.id)
        if item.kind == "message":
            if not whole:
                return message_item(None, status, item.id)
            return message_item(item.text, status, item.id, logprobs=item.logprobs)
        return function_call_item(item.call_id, item.name, item.text if whole else "", status,
                                  item.id)

    def close(self, status: str) -> Iterator[str]:
        """Close the open item (the response's status for its last one)."""
        item, self.open = self.open, None
        if item is None:
            return
        if item is self.message and self.pending_logprobs:
            item.logprobs.extend(self.pending_logprobs)
            self.pending_logprobs = []
        done = self._item(item, status)
        if item.kind == "reasoning":
            part = {"type": "reasoning_text", "text": item.text}
            yield self.ev("response.reasoning_text.done", item_id=item.id,
                          output_index=item.index, content_index=0, text=item.text)
            yield self.ev("response.content_part.done", item_id=item.id,
                          output_index=item.index, content_index=0, part=part)
        elif item.kind == "message":
            yield self.ev("response.output_text.done", item_id=item.id, output_index=item.index,
                          content_index=0, text=item.text, logprobs=item.logprobs)
            yield self.ev("response.content_part.done", item_id=item.id,
                          output_index=item.index, content_index=0,
                          part=done["content"][0])
        else:
            yield self.ev("response.function_call_arguments.done", item_id=item.id,
                          output_index=item.index, name=item.name, arguments=item.text)
        self.output[item.index] = done
        yield self.ev("response.output_item.done", output_index=item.index, item=done)

    @property
    def reasoning(self) -> str:
        return "".join("".join(p["text"] for p in item.get("content", []))
                       for item in self.output if item.get("type") == "reasoning")
