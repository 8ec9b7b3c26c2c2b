"""Compiling structured-output specs to xgrammar grammars, and per-sequence matchers."""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr

from ksana_llm.generation_config import STRUCTURED_OUTPUT_KINDS
from ksana_llm.structured.schema_support import (string_patterns, unenforced_keyword,
                                                 with_required_properties)

if TYPE_CHECKING:
    from ksana_llm.generation_config import StructuredOutputSpec

# Compiled grammars kept per compiler; a compiled JSON schema is a few hundred KiB at most.
DEFAULT_CACHE_SIZE = 256

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "; the client needs the rest.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false: )?")


def _reason(exc: BaseException) -> str:
    return _XGR_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__


def _check_spec(spec: Any) -> tuple[str, str | None]:
    kind = getattr(spec, "kind", None)
    value = getattr(spec, "value", None)
    if kind not in STRUCTURED_OUTPUT_KINDS:
        raise ValueError(f"structured_output.kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
                         f"got {kind!r}")
    if kind == "json_object":
        if value is not None:
            raise ValueError("structured_output.value must be None for kind 'json_object'")
        return kind, None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"structured_output.value must be a non-empty string for kind {kind!r}")
    return kind, value


class GrammarMatcher:
    """One sequence's position in its grammar: which tokens may come next, and whether it ended.

    A matcher terminates once it accepts a stop token (the grammar was complete); a completed
    grammar allows only the stop tokens, which is how the engine forces EOS.
    """

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row `index` of `bitmask` (see allocate_bitmask)."""
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        if self._matcher.is_terminated():
            return False  # xgrammar would log a warning for every such call
        if not 0 <= token_id < self.vocab_size:
            return False
        return bool(self._matcher.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match."""
        return bool(self._matcher.is_terminated())

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (only stop tokens may follow)."""
        return bool(self._matcher.is_completed())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding rejections)."""
        self._matcher.rollback(num_tokens)

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (a new beam or parallel sample)."""
        return GrammarMatcher(self._matcher.fork(), self.vocab_size)

    def reset(self) -> None:
        """Back to the start of the grammar (a preempted sequence that recomputes)."""
        self._matcher.reset()


class GrammarCompiler:
    """Compiles `StructuredOutputSpec`s for one tokenizer, caching each compiled grammar.

    `vocab_size` is the width of the model's logits, which may exceed `len(tokenizer)` (padded
    embeddings); ids past the tokenizer are never allowed. `stop_token_ids` (default: the
    tokenizer's EOS) are the tokens a complete match may end with. Safe to call from several
    threads.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: list[int] | None = None,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        self._stop_token_ids = list(info.stop_token_ids)
        # Our own LRU bounds memory; xgrammar's cache would grow without limit by default.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, os.cpu_count() or 1)),
                                             cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str | None], xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_token_ids)

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; ValueError (naming structured_output) if invalid."""
        key = _check_spec(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(*key)  # outside the lock: a regex can take a second
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, value: str | None) -> xgr.CompiledGrammar:
        """`value` is a non-empty string for every kind but json_object (see _check_spec)."""
        compiler = self._compiler
        # any_whitespace=False: JSON in the canonical ", " / ": " layout. Small models otherwise
        # tend to fill their token budget with newlines and spaces between keys.
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                strict_mode=False)
        if kind == "json_schema":
            try:
                schema = json.loads(str(value))
            except ValueError as exc:
                raise ValueError(f"structured_output: the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_output: a JSON schema must be an object (or a boolean)")
            keyword = unenforced_keyword(schema)
            if keyword is not None:
                raise ValueError(f"structured_output: the JSON schema's `{keyword}` is not "
                                 "supported: the grammar engine (xgrammar) would not enforce it")
            for path, pattern in string_patterns(schema):
                try:
                    xgr.Grammar.from_regex(pattern)
                except (RuntimeError, ValueError, TypeError) as exc:
                    raise ValueError(f"structured_output: the JSON schema's `{path}` is not "
                                     f"supported: {_reason(exc)}") from None
            completed = with_required_properties(schema)
            if completed is not schema:
                value = json.dumps(completed)
            try:
                return compiler.compile_json_schema(str(value), any_whitespace=False)
            except (RuntimeError, ValueError, TypeError) as exc:
                raise ValueError(f"structured_output: invalid JSON schema: {_reason(exc)}") from None
        try:
            if kind == "regex":
                return compiler.compile_regex(str(value))
            return compiler.compile_grammar(str(value))
        except (RuntimeError, ValueError, TypeError) as exc:
            what = "regex" if kind == "regex" else "EBNF grammar"
            raise ValueError(f"structured_output: invalid {what}: {_reason(exc)}") from None

    def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar."""
        return GrammarMatcher(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)
