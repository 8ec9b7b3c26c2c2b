"""Incremental, UTF-8-safe detokenization with stop strings.

A request produces one token at a time, but clients want text: streamed deltas
that (a) never contain half of a multi-byte character, (b) get the spacing of
the first output token right, (c) never contain text that a stop string later
cuts away, and (d) cost O(1) per token instead of re-decoding the whole output.

The work is split in two layers, composed by :class:`IncrementalDetokenizer`:

* :class:`_IncrementalDecoder` turns token ids into *safe* text with the
  prefix_offset / read_offset method used by vLLM and TGI: it decodes only a
  short window ``tokens[prefix_offset:]`` and compares it with the decode of
  ``tokens[prefix_offset:read_offset]`` (text that was already emitted or is
  prompt context). The difference is emitted only when the window does not end
  with U+FFFD, i.e. when it does not end inside a character. Unlike vLLM's, the
  window moves only every few tokens: until then the read part's text is the
  previous decode, which halves the decode calls.
* :class:`_StopStringMatcher` turns safe text into client text: it finds stop
  strings (also ones split across tokens) and holds back a suffix that could
  still grow into a stop string.

Known differences between the joined deltas (+ :meth:`IncrementalDetokenizer.flush`)
and ``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``:

* SentencePiece (Metaspace) tokenizers strip the leading space of the first
  decoded token. Here the first output token is decoded after up to
  ``_PROMPT_CONTEXT_TOKENS`` prompt tokens, so its leading space is *kept*
  (which is the point: "Hello" + " world" must not stream as "Helloworld"),
  while a standalone ``decode(output_ids)`` drops it. Byte-level BPE tokenizers
  (GPT-2, Llama 3, SmolLM2, Qwen) have no such difference.
* ``clean_up_tokenization_spaces=True`` is a non-local rewrite (" ." -> ".")
  that cannot be applied consistently to a sliding window, so it is never used.
* If a decode window stays inside broken UTF-8 for more than
  ``_MAX_UNREAD_TOKENS`` tokens (only happens when a model emits invalid byte
  sequences), the window is emitted as-is, U+FFFD included, to keep the cost
  per token bounded. The emitted text then still matches the full decode unless
  the forced cut happens to split a valid character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["DetokenizerUpdate", "IncrementalDetokenizer"]

# Unicode replacement character: what a decoder produces for bytes that do not
# (yet) form a complete UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens are decoded as context in front of the first output
# token (the same value as vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
# SentencePiece decoders drop the leading space of the first token in a decode
# call; with context in front, the first *output* token is not the first token.
_PROMPT_CONTEXT_TOKENS = 5

# Upper bound on tokens waiting for a character to complete. A UTF-8 character
# is at most 4 bytes, so real text needs only a few; the bound only matters for
# invalid byte streams, where waiting forever would hold back all text and make
# every step re-decode an ever-growing window.
_MAX_UNREAD_TOKENS = 16

# A decode window grows to this many tokens before it moves on. While it grows, the text of its
# read part is the previous decode, so each token costs one decode instead of two; moving costs
# one extra decode. Decoding a few more tokens per call is cheap next to the call itself.
_WINDOW_TOKENS = 8


class _Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer this module uses."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """Result of one :meth:`IncrementalDetokenizer.update` call.

    Attributes:
        delta: Text that became safe to send to the client with this update
            (may be empty).
        stop_str: The stop string that ended the output, or ``None`` while the
            output has not been stopped. Once set, it stays set in every later
            update (whose ``delta`` is always empty).
    """

    delta: str
    stop_str: str | None


def _backend_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust `tokenizers` decode behind a transformers fast tokenizer, when calling it directly
    gives exactly what `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=
    False)` gives: the class must not override transformers' own decode path. None otherwise.

    The transformers wrapper costs about three times the decode itself (argument conversion and
    dispatch), and every generated token is decoded twice, for every sequence of every step.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep the public API
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode \
            or cls._decode is not TokenizersBackend._decode:
        return None
    return lambda token_ids: backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


class _IncrementalDecoder:
    """Token ids -> text that never ends inside a multi-byte character."""

    def __init__(
        self, tokenizer: _Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._fast_decode = _backend_decode(tokenizer, skip_special_tokens)
        # Only the window from prefix_offset on is ever needed, so older tokens
        # are dropped as the window moves (offsets are relative to this list).
        self._token_ids: list[int] = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        # len(decode(tokens[prefix_offset:read_offset])), computed lazily because
        # it only changes when the window moves.
        self._prefix_len: int | None = None

    def _decode(self, token_ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(token_ids)
        if self._tokenizer is None:
            return ""  # a weights-only model (no tokenizer) serves token ids, no text
        # Cleanup is disabled: it rewrites text across token boundaries, so a
        # windowed decode could not reproduce it consistently.
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """Last few prompt tokens, decoded in front of the output but never emitted."""
        # Slicing first keeps this O(1) in the prompt length; int() accepts
        # numpy/torch scalars as well as plain ints.
        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        # A prompt that ends inside a character would let the first output bytes
        # complete it, and the length-based diff below would then swallow them.
        # Without context those bytes decode like in decode(output_ids).
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            return []
        return context

    def append(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens and return the text that is now complete (possibly "")."""
        if self._tokenizer is None:
            return ""  # no text to make: keep no window either (token ids are the output)
        self._token_ids.extend(new_token_ids)
        return self._advance(force=False)

    def finish(self) -> str:
        """Return all remaining text except an incomplete trailing character: its bytes (the
        output was cut inside it) would decode as U+FFFD, which is not text the model wrote.
        vLLM's rule; the token ids keep those bytes."""
        return self._advance(force=True).rstrip(_REPLACEMENT_CHAR)

    def _advance(self, force: bool) -> str:
        unread = len(self._token_ids) - self._read_offset
        if unread == 0:
            return ""
        if self._prefix_len is None:
            self._prefix_len = len(self._decode(self._token_ids[self._prefix_offset : self._read_offset]))
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        complete = len(new_text) > self._prefix_len and not new_text.endswith(_REPLACEMENT_CHAR)
        if not (complete or force or unread > _MAX_UNREAD_TOKENS):
            # Either nothing visible was added (e.g. a skipped special token) or
            # the text ends inside a character: wait for more tokens.
            return ""
        delta = new_text[self._prefix_len :]
        if len(self._token_ids) - self._prefix_offset < _WINDOW_TOKENS:
            # Everything in the window is read now, and its decode is `new_text`: the next
            # window starts at the same place, so its prefix needs no decode of its own.
            self._read_offset = len(self._token_ids)
            self._prefix_len = len(new_text)
        else:
            self._move_window()
        return delta

    def _move_window(self) -> None:
        """Make the just-emitted tokens the context of the next window."""
        del self._token_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._prefix_len = None


class _StopStringMatcher:
    """Safe text -> client text, truncated at the first stop string.

    Invariant: text that was returned by :meth:`feed` is never cut by a stop
    string found later. Therefore, unless the stop string itself is part of the
    output, the longest suffix that is a proper prefix of some stop string is
    held back until it either completes a stop string or can no longer do so.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single string")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stop))  # dedupe, keep order
        self._include = include_stop_str_in_output
        # A stop string that ends in new text starts at most len-1 chars earlier.
        self._lookback_len = max((len(s) for s in self._stops), default=1) - 1
        # With the stop string included in the output, all text before its end
        # is output anyway, so nothing ever needs to be held back.
        self._prefixes: frozenset[str] = (
            frozenset() if self._include else frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        )
        self._lookback = ""  # last _lookback_len chars of all text fed so far
        self._held = ""  # suffix of _lookback that has not been returned yet
        self.stop_str: str | None = None

    def feed(self, text: str, *, match: bool = True) -> str:
        """Add safe text; return the part of it (plus held text) that is final. With `match`
        False (output still short of min_tokens) no stop string may end in this text, though
        one may start in it and end in later text (vLLM's min_tokens)."""
        if self.stop_str is not None or not text:
            return ""
        if not self._stops:
            return text
        window = self._lookback + text
        emit_from = len(self._lookback) - len(self._held)
        found = self._first_match(window, len(self._lookback)) if match else None
        if found is not None:
            return self._stop_at(window, emit_from, *found)
        pending = window[emit_from:]
        hold = self._holdback_len(pending)
        self._held = pending[len(pending) - hold :] if hold else ""
        self._lookback = window[-self._lookback_len :] if self._lookback_len else ""
        return pending[: len(pending) - hold]

    def finish(self) -> str:
        """Release held text: the output ended without completing a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, window: str, new_from: int) -> tuple[str, int] | None:
        """The stop string completed first in ``window`` and its start index.

        "First" means the smallest end index (ties: the longest match). This is
        what a character-by-character stream would find, so the result does not
        depend on how the text happens to be split into tokens. Only matches that
        end in the new text (from ``new_from``) count: one lying entirely in the
        look-back either stopped an earlier call or ended before min_tokens.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = window.find(stop, max(0, new_from - len(stop) + 1))
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[2], best[1])

    def _stop_at(self, window: str, emit_from: int, stop: str, start: int) -> str:
        self.stop_str = stop
        self._held = ""
        cut = start + len(stop) if self._include else start
        return window[emit_from:cut] if cut > emit_from else ""

    def _holdback_len(self, pending: str) -> int:
        """Length of the longest suffix of ``pending`` that could start a stop string."""
        for k in range(min(self._lookback_len, len(pending)), 0, -1):
            if pending[-k:] in self._prefixes:
                return k
        return 0


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens, stopping at stop strings.

    Usage: call :meth:`update` with each step's new token ids and send
    ``update.delta`` to the client; finish the request when ``update.stop_str``
    is set. When the request finishes for another reason (EOS, length limit,
    abort), call :meth:`flush` once and send its result too.

    Each update decodes only a short window of recent tokens, so the cost per
    token does not grow with the length of the output.
    """

    def __init__(
        self,
        tokenizer: _Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """
        Args:
            tokenizer: A Hugging Face tokenizer (anything with ``decode(ids,
                skip_special_tokens=..., clean_up_tokenization_spaces=...)``).
            prompt_token_ids: The prompt; its last few tokens are used as decode
                context so the first output token gets its leading space. No
                prompt text is ever emitted.
            skip_special_tokens: Passed to ``tokenizer.decode``.
            stop: Stop strings; the output ends at the first one completed.
            include_stop_str_in_output: Keep the matched stop string at the end
                of the output instead of cutting before it.
            min_tokens: Stop strings only end the output once it holds more than
                this many tokens; one that ends in earlier text is ignored (vLLM's
                min_tokens).

        Raises:
            ValueError: If a stop string is empty.
            TypeError: If ``stop`` is a single string instead of a sequence.
        """
        self._decoder = _IncrementalDecoder(tokenizer, prompt_token_ids, skip_special_tokens)
        self._matcher = _StopStringMatcher(stop, include_stop_str_in_output)
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._pieces: list[str] = []
        self._flushed = False

    @property
    def output_text(self) -> str:
        """All text emitted so far: every delta, plus the flush output once flushed."""
        if len(self._pieces) > 1:
            # Join lazily and keep the result, so repeated reads stay cheap.
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, or ``None``."""
        return self._matcher.stop_str

    @property
    def finished(self) -> bool:
        """True once a stop string matched or :meth:`flush` was called."""
        return self._flushed or self._matcher.stop_str is not None

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Append generated tokens and return the text that became safe to emit.

        After a stop string matched, tokens are ignored and the delta is empty.

        Raises:
            RuntimeError: If called after :meth:`flush`.
        """
        if self._flushed:
            raise RuntimeError("update() called after flush(); the request has finished")
        if self._matcher.stop_str is not None:
            return DetokenizerUpdate("", self._matcher.stop_str)
        self._num_tokens += len(new_token_ids)
        delta = self._matcher.feed(self._decoder.append(new_token_ids),
                                   match=self._num_tokens > self._min_tokens)
        self._record(delta)
        return DetokenizerUpdate(delta, self._matcher.stop_str)

    def flush(self) -> str:
        """Return the text still held back, for a request that ends without a stop string.

        That is the text of tokens held back for an incomplete character, less
        the incomplete character itself (the output ended inside it: as in
        vLLM, the text never ends in the U+FFFD its bytes decode to; the token
        ids keep them), and any suffix held back because it could have started
        a stop string. The decoded tail still goes through stop string
        matching, so if it completes a stop string, the output is cut there and
        :attr:`stop_str` is set. Returns "" after a stop string matched, and on
        every call after the first.
        """
        if self._flushed:
            return ""
        self._flushed = True
        if self._matcher.stop_str is not None:
            return ""
        text = self._matcher.feed(self._decoder.finish(),
                                  match=self._num_tokens > self._min_tokens)
        text += self._matcher.finish()
        self._record(text)
        return text

    def _record(self, text: str) -> None:
        if text:
            self._pieces.append(text)
