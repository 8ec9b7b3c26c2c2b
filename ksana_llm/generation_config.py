"""Per-request generation settings, validated at construction.

This module is a leaf: the engine core, the Python API and the server all import it, and it
imports nothing of theirs.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


STRUCTURED_OUTPUT_KINDS = ("json_object", "json_schema", "regex", "grammar")
MAX_LOGPROBS = 20  # default EngineConfig.max_logprobs: top alternatives a request may ask for
LOGIT_BIAS_RANGE = 100.0
# A temperature below this samples as greedy (vLLM's rule): dividing logits by ~1e-38 overflows
# them to inf, and the softmax of infs is NaN.
MIN_SAMPLING_TEMPERATURE = 1e-5

_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "no_repeat_ngram_size", "num_beams",
               "num_return_sequences")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "length_penalty")
_BOOL_FIELDS = ("do_sample", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                "detokenize")
_OPTIONAL_INT_FIELDS = ("logprobs", "seed", "best_of", "prompt_logprobs", "truncate_prompt_tokens",
                        "thinking_token_budget")


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match: `kind` is "json_object" (any JSON object, `value` None),
    "json_schema" (`value`: the schema as a JSON string), "regex" or "grammar" (EBNF, as xgrammar
    reads it). Whether `value` itself is valid is checked when the engine compiles it at submit."""

    kind: str
    value: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            _fail("structured_output.kind", self.kind, f"one of {', '.join(STRUCTURED_OUTPUT_KINDS)}")
        if self.kind == "json_object":
            if self.value is not None:
                _fail("structured_output.value", self.value, "None for kind 'json_object'")
        elif not isinstance(self.value, str) or not self.value.strip():
            _fail("structured_output.value", self.value, f"a non-empty string for kind {self.kind!r}")

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutputSpec:
        """Exactly one of `choices` (vLLM's `choice`): a grammar whose alternatives are the
        strings."""
        if not isinstance(choices, (list, tuple)) or not choices or not all(
                isinstance(c, str) and c for c in choices):
            _fail("structured_output.choice", choices, "a non-empty list of non-empty strings")
        # EBNF string literals take JSON-style escapes, but not a surrogate pair's two halves
        # (an emoji's \ud83d\ude00 would become two invalid code points): non-ASCII stays as is.
        return cls("grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                       for c in choices))


def _plain_int(value: Any) -> Any:
    """A numpy (or other) integer as a Python int; anything else unchanged, for validation."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) \
        else value


def _plain_ints(values: list[Any] | tuple[Any, ...]) -> list[Any]:
    return [_plain_int(v) for v in values]


@dataclass
class GenerationConfig:
    """How one request generates. Defaults follow `transformers`: greedy unless `do_sample=True`,
    but `top_k` is off (0) unless set, as in vLLM and OpenAI (transformers' default is 50).

    Sampling happens only when `do_sample` is True and `temperature` is at least 1e-5 (below it,
    as in vLLM, the argmax is taken, as it is without `do_sample`; the penalties still apply).

    Several sequences per request:
    - sampling (or greedy) with `num_return_sequences` = n > 1: n sequences share the prompt's KV
      blocks; with `best_of` = m >= n, m are generated and the n with the highest cumulative
      log-prob are returned, best first. Sequence i of a seeded request draws from seed + i, so it
      equals a single request with that seed.
    - beam search (`num_beams` > 1, `transformers` semantics: `length_penalty` divides a finished
      hypothesis' summed log-prob by its generated length ** length_penalty; `early_stopping`
      True / False / "never"): the best `num_return_sequences` hypotheses, best first.

    `min_new_tokens` holds back EOS and `stop_token_ids` (transformers) and, as in vLLM, stop
    strings: one that ends within the first `min_new_tokens` tokens' text does not stop the
    output (beam search keeps transformers' stop-string rule).

    `logit_bias` adds to the logits of token ids (OpenAI semantics, like transformers'
    `SequenceBiasLogitsProcessor` with one-token sequences). `prompt_logprobs` = k returns, for
    every prompt token after the first, its log-prob and the k most likely alternatives.
    `structured_output` constrains the output to a JSON schema, regex or grammar (xgrammar).
    `bad_words_ids` (transformers' name) lists token sequences never generated: a one-token
    sequence is never sampled, a longer one's last token is not once the sequence (prompt and
    output) ends with the rest. `allowed_token_ids` (vLLM's) restricts every sampled token to
    those ids.

    `detokenize=False` (vLLM's) returns token ids with empty text: no decoding per token, which
    a caller reading ids only (an RL trainer, a benchmark) does not need; stop strings, which are
    found in the text, are refused with it.

    `thinking_token_budget` (vLLM's) caps the tokens of the model's thinking block: once the
    block holds that many, the engine forces its end (`EngineConfig.reasoning_config` says
    which text opens and ends it; `serve --reasoning-parser` sets it). With a reasoning config,
    `structured_output` constrains the answer after the thinking block, not the thinking.

    `truncate_prompt_tokens` (vLLM's) keeps only the prompt's last k tokens (-1: as many as
    the engine's max_model_len), for prompts given as text, token ids or `prompt_embeds` rows.

    `logits_processors` (vLLM's per-request processors; Python only, never over HTTP): callables
    `fn(output_token_ids, logits)` or `fn(prompt_token_ids, output_token_ids, logits)` that get
    the row's float32 logits [vocab] after the built-in processors (transformers' order: custom
    processors last, before temperature / top-k / top-p) and return the logits to sample from
    (the same tensor changed in place, or a new one). They run on the host's view of the
    sequence, once per generated token; a request with them is not drafted for by speculative
    decoding. One that raises or returns something else fails its request only. Copies of a
    config (`replace`, and the engine's per-request copy) share the processor objects, so a
    stateful processor sees every call, unless it has a `clone()` method (vLLM's rule): then
    each copy gets a clone.
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
    # vLLM's: False leaves the output's text empty (token ids only), saving the decoding.
    detokenize: bool = True
    # None: none; k >= 0: sampled token + k top alternatives; -1: the whole vocabulary (vLLM's)
    logprobs: int | None = None
    seed: int | None = None
    best_of: int | None = None  # sequences generated (>= num_return_sequences); None: as many
    early_stopping: bool | str = False  # beam search only: True, False or "never"
    logit_bias: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: int | None = None  # as logprobs, for each prompt token
    structured_output: StructuredOutputSpec | None = None
    bad_words_ids: list[list[int]] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    logits_processors: list[Callable[..., Any]] = field(default_factory=list)
    # vLLM's: keep the prompt's last k tokens (-1: as many as max_model_len); None keeps all.
    truncate_prompt_tokens: int | None = None
    # vLLM's: the most tokens the thinking block may hold before its end is forced; None: no cap.
    thinking_token_budget: int | None = None
    # vLLM's SamplingParams.extra_args (`vllm_xargs` over HTTP): settings for the engine's own
    # logits processors (ksana_llm.LogitsProcessor); the engine itself reads none of them.
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # numpy / torch scalars (as transformers users pass them) become Python numbers.
        for name in (*_INT_FIELDS, *_OPTIONAL_INT_FIELDS):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
                setattr(self, name, float(value))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.stop_token_ids, list):
            self.stop_token_ids = _plain_ints(self.stop_token_ids)
        if self.bad_words_ids is None:
            self.bad_words_ids = []
        if isinstance(self.bad_words_ids, (list, tuple)):
            self.bad_words_ids = [_plain_ints(w) if isinstance(w, (list, tuple)) else w
                                  for w in self.bad_words_ids]
        if isinstance(self.allowed_token_ids, (list, tuple)):
            self.allowed_token_ids = _plain_ints(self.allowed_token_ids)
        if self.logits_processors is None or isinstance(self.logits_processors, tuple):
            self.logits_processors = list(self.logits_processors or [])
        if self.extra_args is None:
            self.extra_args = {}
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict):
            # JSON objects (OpenAI's logit_bias) arrive with string keys: "50256" -> 50256;
            # numpy numbers become Python's, as in the other token-id fields.
            self.logit_bias = {
                _plain_int(int(k) if isinstance(k, str) and k.strip().isdecimal() else k):
                float(v) if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float))
                else v for k, v in self.logit_bias.items()}
        elif self.logit_bias is None:
            self.logit_bias = {}
        if isinstance(self.structured_output, dict):
            try:
                self.structured_output = StructuredOutputSpec(**self.structured_output)
            except TypeError:
                _fail("structured_output", self.structured_output,
                      "a StructuredOutputSpec or a dict with 'kind' and 'value'")
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and its allowed range. The engine
        runs it again on every submitted config (a field may have been set since), as
        transformers' `generate` does."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                _fail(name, value, "an integer")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail(name, value, "a number")
            if not math.isfinite(value):
                _fail(name, value, "a finite number")
        for name in _BOOL_FIELDS:
            # A flag given as 0, "false" or None would be read by truthiness somewhere and by
            # type elsewhere (the tokenizer refuses a non-bool skip_special_tokens).
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "True or False")
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
        if self.num_beams < 1:
            _fail("num_beams", self.num_beams, ">= 1")
        if self.num_return_sequences < 1:
            _fail("num_return_sequences", self.num_return_sequences, ">= 1")
        if self.best_of is not None and (
                not _is_int(self.best_of) or self.best_of < self.num_return_sequences):
            _fail("best_of", self.best_of,
                  f"None or an integer >= num_return_sequences ({self.num_return_sequences})")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            _fail("early_stopping", self.early_stopping, "True, False or 'never'")
        # The forms the constructor takes (one string, tuples) pass here too: a field set after
        # construction is checked as set, and the request's copy normalises it.
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            _fail("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):  # counts; the engine's max_logprobs caps them
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                _fail(name, value, "None, an integer >= 0 or -1 (the whole vocabulary)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            # The generator's 64 bits (as the server's bound): beyond them two seeds would
            # silently draw alike.
            _fail("seed", self.seed, "None or an integer in [-2**63, 2**64)")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.stop and self.detokenize is False:
            _fail("stop", self.stop, "empty with detokenize=False (stop strings are found in the "
                                     "text, which is not made)")
        if self.thinking_token_budget is not None and (
                not _is_int(self.thinking_token_budget) or self.thinking_token_budget < 0):
            _fail("thinking_token_budget", self.thinking_token_budget,
                  "None or an integer >= 0")
        self._validate_logit_bias()
        if not isinstance(self.bad_words_ids, list) or not all(
                isinstance(w, list) and w and all(_is_int(t) and t >= 0 for t in w)
                for w in self.bad_words_ids):
            _fail("bad_words_ids", self.bad_words_ids,
                  "a list of non-empty lists of non-negative token ids")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            _fail("allowed_token_ids", self.allowed_token_ids,
                  "None or a non-empty list of non-negative token ids")
        if self.allowed_token_ids is not None and set(self.allowed_token_ids) <= {
                w[0] for w in self.bad_words_ids if len(w) == 1}:
            _fail("allowed_token_ids", self.allowed_token_ids,
                  "ids not all banned by bad_words_ids (nothing could be generated)")
        self._validate_logits_processors()
        if not isinstance(self.extra_args, dict) or not all(
                isinstance(k, str) for k in self.extra_args):
            _fail("extra_args", self.extra_args, "a dict keyed by strings")
        if self.structured_output is not None and not isinstance(self.structured_output,
                                                                 StructuredOutputSpec):
            _fail("structured_output", self.structured_output, "None or a StructuredOutputSpec")
        if self.num_beams > 1:
            self._validate_beam_search()
        else:
            if self.length_penalty != 1.0:
                _fail("length_penalty", self.length_penalty, "1.0 unless num_beams > 1 (beam search)")
            if self.early_stopping is not False:
                _fail("early_stopping", self.early_stopping, "False unless num_beams > 1 (beam search)")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict):
            _fail("logit_bias", bias, "a dict of token id -> bias")
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                _fail("logit_bias", token, "keyed by non-negative integer token ids")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
                raise ValueError(f"logit_bias values must be numbers in [-{LOGIT_BIAS_RANGE:g}, "
                                 f"{LOGIT_BIAS_RANGE:g}], got {value!r} for token {token}")

    def _validate_logits_processors(self) -> None:
        if not isinstance(self.logits_processors, list):
            _fail("logits_processors", self.logits_processors, "a list of callables")
        for i, fn in enumerate(self.logits_processors):
            if not callable(fn) or processor_arity(fn) not in (2, 3):
                _fail(f"logits_processors[{i}]", fn, "a callable taking (output_token_ids, logits) "
                      "or (prompt_token_ids, output_token_ids, logits)")

    def _validate_beam_search(self) -> None:
        """Beam search is deterministic: sampling knobs cannot apply, so they are errors."""
        if self.num_return_sequences > self.num_beams:
            _fail("num_return_sequences", self.num_return_sequences,
                  f"<= num_beams ({self.num_beams}) with beam search")
        if self.do_sample:
            _fail("do_sample", self.do_sample, "False with beam search (num_beams > 1)")
        for name, neutral in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
            if getattr(self, name) != neutral:
                _fail(name, getattr(self, name), f"{neutral} with beam search (num_beams > 1)")
        if self.best_of is not None:
            _fail("best_of", self.best_of, "None with beam search (num_beams is the beam width)")
        if self.structured_output is not None:
            _fail("structured_output", self.structured_output, "None with beam search (num_beams > 1)")
        if self.thinking_token_budget is not None:
            _fail("thinking_token_budget", self.thinking_token_budget,
                  "None with beam search (num_beams > 1)")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def use_beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request: the beams, or best_of / n samples."""
        if self.use_beam_search:
            return self.num_beams
        return self.best_of or self.num_return_sequences

    @property
    def ranks_sequences(self) -> bool:
        """Whether the returned sequences are chosen and ordered at the end (beam search, or
        best_of > n), so nothing can be streamed before the request finishes."""
        return self.use_beam_search or self.num_sequences > self.num_return_sequences

    def replace(self, **changes: Any) -> GenerationConfig:
        """A validated copy with some fields changed; unknown names raise ValueError. The copy
        shares no list or dict with this config (changing one never changes the other)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown generation parameter(s): {', '.join(unknown)}")
        # Processors are not deep-copied: a stateful one must see its request's calls. One with
        # a clone() method (vLLM's rule) gives each copy its own, fresh state included.
        processors = [*self.logits_processors]
        if isinstance(changes.get("logits_processors"), (list, tuple)):
            processors += changes["logits_processors"]
        memo = {id(fn): fn.clone() if callable(getattr(fn, "clone", None)) else fn
                for fn in processors}
        try:
            copied, changed = copy.deepcopy(self, memo), copy.deepcopy(changes, memo)
        except (TypeError, copy.Error) as exc:  # e.g. a lock or an open file in extra_args
            raise ValueError(f"generation config: every value must be copyable (each request "
                             f"keeps its own copy), extra_args included: {exc}") from exc
        return dataclasses.replace(copied, **changed)


def check_truncate_prompt_tokens(value: Any) -> None:
    """ValueError unless `value` is a valid truncate_prompt_tokens (None, -1 or k >= 1)."""
    if value is not None and (not _is_int(value) or not (value == -1 or value >= 1)):
        _fail("truncate_prompt_tokens", value,
              "None, -1 (as many as max_model_len) or an integer >= 1")


def processor_arity(fn: Callable[..., Any]) -> int:
    """How many arguments a logits processor takes: 3 (prompt ids first) or 2 (its required
    positional parameters; a torch Module's are its forward's). One taking *args, or whose
    signature cannot be read, counts as 2: vLLM's form."""
    # A Module's __call__ is (*args, **kwargs): what it takes is its forward's signature.
    forward = getattr(fn, "forward", None)
    is_object = not (inspect.isfunction(fn) or inspect.ismethod(fn))
    target = forward if is_object and callable(forward) else fn
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return 2
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return 2
    return sum(1 for p in parameters if p.default is inspect.Parameter.empty and p.kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def _refuse_unknown_names(init: Any) -> Any:
    """Wrap the dataclass `__init__`: an unknown name (transformers' `max_length`,
    `stop_strings`, ...) is a ValueError naming it, as in `replace`, not a bare TypeError."""
    def __init__(self: GenerationConfig, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _FIELD_NAMES)
        if unknown:
            raise ValueError(f"unknown generation parameter(s): {', '.join(unknown)}")
        init(self, *args, **kwargs)

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]
    return __init__


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(GenerationConfig))
GenerationConfig.__init__ = _refuse_unknown_names(GenerationConfig.__init__)  # type: ignore[method-assign]
