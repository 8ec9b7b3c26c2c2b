"""Per-request generation settings, validated at construction.

This module is a leaf: the engine core, the Python API and the server all import it, and it
imports nothing of theirs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class GenerationConfig:
    """How one request generates. Defaults follow `transformers`: greedy unless `do_sample=True`.

    Sampling happens only when `do_sample` is True and `temperature > 0`; otherwise the argmax is
    taken (the penalties still apply).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    length_penalty: float = 1.0
    num_beams: int = 1
    num_return_sequences: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + k top alternatives
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and its allowed range."""
        ints = ("max_new_tokens", "min_new_tokens", "top_k", "no_repeat_ngram_size", "num_beams",
                "num_return_sequences")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                _fail(name, value, "an integer")
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "length_penalty")
        for name in floats:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail(name, value, "a number")
            if value != value:  # NaN
                _fail(name, value, "a finite number")
        if self.max_new_tokens < 1:
            _fail("max_new_tokens", self.max_new_tokens, ">= 1")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            _fail("min_new_tokens", self.min_new_tokens, "in [0, max_new_tokens]")
        if self.temperature < 0:
            _fail("temperature", self.temperature, ">= 0")
        if self.top_k < 0:
            _fail("top_k", self.top_k, ">= 0 (0 or -1 disables it)")
        if not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "in (0, 1]")
        if not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "in [0, 1]")
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "> 0")
        if not -2 <= self.presence_penalty <= 2:
            _fail("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            _fail("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.no_repeat_ngram_size < 0:
            _fail("no_repeat_ngram_size", self.no_repeat_ngram_size, ">= 0")
        if self.num_beams != 1:
            _fail("num_beams", self.num_beams, "1 (beam search is not supported yet)")
        if self.num_return_sequences != 1:
            _fail("num_return_sequences", self.num_return_sequences,
                  "1 (parallel sampling is not supported yet)")
        if self.no_repeat_ngram_size != 0:
            _fail("no_repeat_ngram_size", self.no_repeat_ngram_size, "0 (not supported yet)")
        if not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", self.stop, "a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if self.logprobs is not None and (
                isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                or not 0 <= self.logprobs <= 20):
            _fail("logprobs", self.logprobs, "None or an integer in [0, 20]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            _fail("seed", self.seed, "None or an integer")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def replace(self, **changes: Any) -> GenerationConfig:
        """A validated copy with some fields changed; unknown names raise ValueError."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown generation parameter(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)
