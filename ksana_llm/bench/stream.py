"""Reading a server's streamed answers, as bytes arrive: OpenAI's Server-Sent Events and
KsanaLLM's NUL-delimited JSON chunks (pure functions, unit-tested without a server)."""

from __future__ import annotations

import json
from typing import Any


class SSEDecoder:
    """Incremental Server-Sent-Events decoder: bytes in, complete event `data` payloads out.

    Network reads split events anywhere, so partial lines are buffered. Multi-line `data:` fields
    of one event are joined with a newline, as the SSE spec says; comments and other fields are
    ignored.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return events
            line = self._buffer[:newline].rstrip(b"\r").decode("utf-8")
            self._buffer = self._buffer[newline + 1:]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))

    def flush(self) -> list[str]:
        """Events left when the stream closed without a final blank line."""
        events = self.feed(b"\n\n") if (self._buffer or self._data) else []
        self._buffer = b""
        return events


class NulChunkDecoder:
    """KsanaLLM's native stream: JSON objects each followed by a NUL byte."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        self._buffer += chunk
        *complete, self._buffer = self._buffer.split(b"\0")
        return [json.loads(piece) for piece in complete if piece.strip()]

    def flush(self) -> list[dict[str, Any]]:
        rest, self._buffer = self._buffer, b""
        return [json.loads(rest)] if rest.strip() else []


def error_message(body: Any) -> str | None:
    """The error a server put in a 200 answer or stream chunk (`{"error": ...}`: an OpenAI-style
    object with a message, or any other value), else None."""
    if not isinstance(body, dict) or "error" not in body:
        return None
    error = body["error"]
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def openai_chunk_text(event: dict[str, Any]) -> str:
    """Text carried by one OpenAI stream chunk (completions `text` or chat `delta.content`)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def openai_chunk_has_tokens(event: dict[str, Any]) -> bool:
    """Whether an OpenAI stream chunk marks generated tokens arriving: any chunk with a choice,
    even one of empty text (an answer of EOS alone, a stop string held back), except chat's
    opening `role` announcement, which this server sends before the first token."""
    choices = event.get("choices") or []
    return bool(choices) and "role" not in (choices[0].get("delta") or {})


def first_sequence(value: Any) -> Any:
    """KsanaLLM returns one entry per sequence (`texts`, `output_token_ids`): take the first."""
    if isinstance(value, list) and value and isinstance(value[0], (list, str)):
        return value[0]
    return value


def ksana_chunk_state(chunk: dict[str, Any]) -> tuple[str, int, int | None]:
    """(text so far, output tokens so far, input tokens or None) of a cumulative /generate chunk."""
    text = first_sequence(chunk.get("texts") or [""])
    tokens = first_sequence(chunk.get("output_token_ids") or [])
    inputs = chunk.get("input_token_ids")
    return (text if isinstance(text, str) else "", len(tokens) if isinstance(tokens, list) else 0,
            len(inputs) if isinstance(inputs, list) else None)
