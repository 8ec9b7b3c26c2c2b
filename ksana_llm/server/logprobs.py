"""Engine logprob entries -> the two OpenAI formats (completions and chat).

The engine reports, per generated token, `{"token_id", "logprob", "top_logprobs": {id: logprob}}`.
OpenAI wants token *strings* plus, for chat, the token's raw UTF-8 bytes: a byte-level BPE token
may hold half of a multi-byte character, so its text alone cannot be reassembled by a client.
"""

from __future__ import annotations

import codecs
import math
from typing import Any

from ksana_llm.server.openai_protocol import (
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (char -> byte)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenTexts:
    """Token id -> (text, raw bytes), cached per tokenizer (one instance lives in app.state)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_map = _byte_level_alphabet() if "ByteLevel" in repr(decoder) else None

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw: bytes | None = None
        if self._byte_map is not None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_map for c in piece):
                raw = bytes(self._byte_map[c] for c in piece)
        if raw is None:
            raw = self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        entry = (raw.decode("utf-8", errors="replace"), raw)
        self._cache[token_id] = entry
        return entry

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


class TokenIdTexts:
    """vLLM's `return_tokens_as_token_ids`: each token named "token_id:<id>" (its bytes those of
    that name), so a client can tell apart tokens whose text is not valid UTF-8 on its own."""

    def get(self, token_id: int) -> tuple[str, bytes]:
        name = self.text(token_id)
        return name, name.encode("ascii")

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number, so clamp like other servers do.
    return value if math.isfinite(value) else -9999.0


def _completion_top(entry: dict[str, Any], token: str, texts: TokenTexts | TokenIdTexts
                    ) -> dict[str, float]:
    """The completions format's alternatives: the top ones, then the chosen token when it is not
    among them ("up to logprobs + 1 elements", as OpenAI and vLLM give; with logprobs 0 just it)."""
    top = {texts.text(t): _finite(lp) for t, lp in entry.get("top_logprobs", {}).items()}
    top.setdefault(token, _finite(entry["logprob"]))
    return top


class TextOffsets:
    """The completions format's `text_offset`: where each token starts in the returned text, in
    characters. Counted from the tokens' bytes, not their display strings: the two halves of a
    character split across tokens each display as U+FFFD, and counting those would run past the
    text. A token that starts inside a character gets that character's offset. One instance
    follows one choice across echo and streamed chunks."""

    def __init__(self, start: int = 0) -> None:
        self._chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """The offset of the token holding `raw`; moves past it."""
        offset = self._chars
        self._chars += len(self._decoder.decode(raw))
        return offset


def completion_logprobs(entries: list[dict[str, Any]], texts: TokenTexts | TokenIdTexts,
                        offsets: TextOffsets) -> CompletionLogprobs:
    """`offsets` already counts the text returned before these tokens (echo, earlier chunks)."""
    out = CompletionLogprobs()
    for entry in entries:
        token, raw = texts.get(entry["token_id"])
        out.tokens.append(token)
        out.token_logprobs.append(_finite(entry["logprob"]))
        out.top_logprobs.append(_completion_top(entry, token, texts))
        out.text_offset.append(offsets.advance(raw))
    return out


def chat_logprobs(entries: list[dict[str, Any]], texts: TokenTexts | TokenIdTexts) -> ChatLogprobs:
    content = []
    for entry in entries:
        token, raw = texts.get(entry["token_id"])
        tops = []
        for token_id, lp in entry["top_logprobs"].items():
            t, b = texts.get(token_id)
            tops.append(TopLogprob(token=t, logprob=_finite(lp), bytes=list(b)))
        content.append(ChatLogprobEntry(token=token, logprob=_finite(entry["logprob"]),
                                        bytes=list(raw), top_logprobs=tops))
    return ChatLogprobs(content=content)


# ---- prompt logprobs -------------------------------------------------------------------------------
# The engine reports them per prompt token, aligned with the prompt: None for the first token (it
# has no context), then entries like the generated ones ({"token_id", "logprob", "top_logprobs"}).

def prompt_logprobs_entries(output: Any) -> list[dict[str, Any] | None]:
    entries = getattr(output, "prompt_logprobs", None)
    if entries is None:
        raise RuntimeError("the engine returned no prompt logprobs although they were asked for")
    return list(entries)


def completion_prompt_logprobs(entries: list[dict[str, Any] | None] | None, prompt_ids: list[int],
                               texts: TokenTexts | TokenIdTexts, offsets: TextOffsets
                               ) -> CompletionLogprobs:
    """echo + logprobs: the prompt tokens in the completions format (the first one null)."""
    out = CompletionLogprobs()
    for i, token_id in enumerate(prompt_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        token, raw = texts.get(token_id)
        out.tokens.append(token)
        out.text_offset.append(offsets.advance(raw))
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(entry["logprob"]))
        out.top_logprobs.append(_completion_top(entry, token, texts))
    return out


def vllm_prompt_logprobs(entries: list[dict[str, Any] | None], prompt_ids: list[int],
                         texts: TokenTexts | TokenIdTexts) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: logprob,
    rank (1 = most likely), decoded_token} for the actual token and the top alternatives."""
    out: list[dict[str, PromptLogprob] | None] = []
    for i, token_id in enumerate(prompt_ids):
        entry = entries[i] if i < len(entries) else None
        if entry is None:
            out.append(None)
            continue
        tops = entry.get("top_logprobs", {})
        ranked = sorted(tops.items(), key=lambda kv: kv[1], reverse=True)
        item = {str(t): PromptLogprob(logprob=_finite(lp), rank=r + 1, decoded_token=texts.text(t))
                for r, (t, lp) in enumerate(ranked)}
        actual = entry.get("token_id", token_id)
        if str(actual) not in item:
            item[str(actual)] = PromptLogprob(logprob=_finite(entry["logprob"]), rank=entry.get("rank"),
                                              decoded_token=texts.text(actual))
        out.append(item)
    return out
