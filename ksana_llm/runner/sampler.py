"""Batched next-token selection: penalties, warpers and sampling for one decoding step.

Everything runs on the logits' device (CPU or CUDA, same code) in float32 and is vectorised
across the batch with per-row parameter tensors, so a batch of requests with different settings
costs a handful of kernels rather than one pass per request.

Order of operations (that of `transformers.generate`, so greedy outputs match it):

0. Structured output: rows with a grammar matcher get their disallowed tokens masked to -inf
   first (xgrammar bitmask), so nothing below can revive them. A row the processors below then
   leave with no token at all (min_new_tokens against a finished document) keeps the grammar's
   choices alone (`keep_grammar_choices`).
1. `process_logits` (in `runner.logits_processing`), in `transformers`' processor order: logit
   bias (`SequenceBiasLogitsProcessor`), HF repetition penalty over prompt and output,
   `no_repeat_ngram_size` over prompt and output (`NoRepeatNGramLogitsProcessor`),
   min_new_tokens EOS/stop suppression, then OpenAI presence/frequency penalties over the
   output, then the request's own `logits_processors` (Python callables, one row at a time).
   Applies to every row.
2. `warp_logits` (sampling rows only): temperature, top-k, top-p, min-p with the semantics of
   `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`.
3. Greedy rows take the argmax of the processed logits; sampling rows are drawn with the
   exponential race (`argmax(probs / E)`, `E ~ Exponential(1)`), which is an exact categorical
   sample and lets every row draw its noise from its own generator: a seeded request draws each
   position's noise from (seed, position) alone (`SeededDraws`), so it yields the same tokens
   whatever else shares its batch, and with or without speculative drafts.

The repetition, presence and frequency penalties and the n-gram bans read each row's token ids
from a table the sampler keeps on the device (`runner.token_history`) and extends with each
token it samples, so they need neither the host's token lists nor the previous step's token on
the host; the engine calls `Sampler.release` when a sequence is done.

Log-probs are those of the raw model distribution (log_softmax of the unprocessed logits), as
vLLM reports them by default; its other `logprobs_mode`s are in `runner.logprobs_mode`.

Beam search does not sample: `beam_log_probs` gives the engine each beam's log-probs with the
processors applied to log_softmax(logits), which is what `transformers` beam search scores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ksana_llm.generation_config import GenerationConfig, processor_arity
from ksana_llm.logits_processor import LogitsProcessor, LogitsRow
from ksana_llm.runner.grammar_masks import (apply_grammar_masks, keep_grammar_choices,
                                            remask_grammar_rows)
from ksana_llm.runner.logits_processing import process_logits, to_device
from ksana_llm.runner.logprobs_mode import check_logprobs_mode, chosen_ranks, reported_values
from ksana_llm.runner.sampled_tokens import SamplerOutput
from ksana_llm.runner.token_history import TokenHistories

logger = logging.getLogger("ksana_llm.runner")

__all__ = [
    "SamplingRow",
    "SamplerOutput",
    "Sampler",
    "beam_log_probs",
    "SeededDraws",
    "seeded_draws",
    "process_logits",
    "warp_logits",
]


# splitmix64's constants: the golden-ratio step between positions, and its finaliser's.
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def _mix64(value: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


@dataclass
class SeededDraws:
    """The random draws of one seeded sequence. The token at output position t draws its noise
    from a generator seeded with (seed, t) alone, so a seeded sample depends on nothing but its
    seed and its distributions: not on what shares its batches, and not on how many of its
    tokens one step decided (speculative decoding verifies several positions at once; a draft
    stands where it is the token this position's draw picks, so the output is the one without
    drafts)."""

    seed: int
    generator: torch.Generator  # on the logits' device: `exponential_` takes no other

    def at(self, position: int) -> torch.Generator:
        """The generator, seeded for output position `position` (reseeding is a host-side
        setting: a draw already launched keeps the seed it was launched with)."""
        self.generator.manual_seed(_mix64((self.seed + _GOLDEN64 * (position + 1)) & _MASK64))
        return self.generator


def seeded_draws(seed: int, device: torch.device | str) -> SeededDraws:
    """The draws of one seeded sequence, created once per sequence by the engine (any Python
    int: it is folded into 64 bits)."""
    return SeededDraws(seed & _MASK64, torch.Generator(device=torch.device(device)))


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request at this step."""

    config: GenerationConfig
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # A seeded sequence's draws (`seeded_draws`); None: the Sampler's shared generator.
    draws: SeededDraws | None = None
    # Suppressed (with config.stop_token_ids) while len(output_token_ids) < min_new_tokens. The
    # engine decides what goes here (e.g. nothing when the request ignores EOS).
    eos_token_ids: tuple[int, ...] = ()
    # Structured output: a grammar matcher (`ksana_llm.structured.GrammarMatcher`) whose bitmask
    # masks this row first. The sampler only reads it; the engine feeds it the chosen token.
    matcher: Any = None
    # The chosen token's log-prob is wanted even without config.logprobs (best_of ranking).
    need_logprob: bool = False
    # Whether its processors read the token ids the sampler keeps on the device (repetition,
    # presence and frequency penalties, n-gram bans: see `runner.token_history`).
    uses_token_history: bool = field(init=False)
    # allowed_token_ids as a device mask, built at the row's first step (logits_processing).
    allowed_mask: Any = field(default=None, init=False, repr=False)
    # config.logits_processors with whether each takes the prompt ids (read once, not per step).
    custom_processors: tuple[tuple[Callable[..., Any], bool], ...] = field(init=False, repr=False)
    # Why a custom processor failed this row (logits_processing): the engine fails its request
    # (a ValueError for its own processors, a LogitsProcessorError for the engine's).
    processor_error: Exception | None = field(default=None, init=False, repr=False)
    # The engine-wide processors (ksana_llm.LogitsProcessor) that apply to the row's request,
    # and who the row is to them (its request id and sample index).
    engine_processors: tuple[Any, ...] = ()
    request_id: str = ""
    index: int = 0
    # The row as engine-wide processors see it (a ksana_llm.LogitsRow), made at first use.
    _view: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        config = self.config
        self.uses_token_history = (config.repetition_penalty != 1.0
                                   or config.presence_penalty != 0.0
                                   or config.frequency_penalty != 0.0
                                   or config.no_repeat_ngram_size > 0
                                   or any(len(w) > 1 for w in config.bad_words_ids))
        self.custom_processors = tuple((fn, processor_arity(fn) == 3)
                                       for fn in config.logits_processors)

    @property
    def view(self) -> LogitsRow:
        """The row as engine-wide processors see it: its request, config and live token lists."""
        if self._view is None:
            self._view = LogitsRow(self.request_id, self.index, self.config,
                                   self.prompt_token_ids, self.output_token_ids)
        return self._view

    @property
    def suppresses_stop(self) -> bool:
        """Whether min_new_tokens still forbids the stop tokens at this step."""
        return len(self.output_token_ids) < self.config.min_new_tokens and bool(
            self.eos_token_ids or self.config.stop_token_ids)

    @property
    def has_processors(self) -> bool:
        """Whether its logits go through `process_logits` (min_new_tokens aside)."""
        config = self.config
        return (bool(self.custom_processors) or bool(self.engine_processors)
                or config.repetition_penalty != 1.0 or config.presence_penalty != 0.0
                or config.frequency_penalty != 0.0 or config.no_repeat_ngram_size > 0
                or bool(config.logit_bias) or bool(config.bad_words_ids)
                or config.allowed_token_ids is not None)

    @property
    def wants_logprob(self) -> bool:
        return self.need_logprob or self.config.logprobs is not None


def beam_log_probs(logits: torch.Tensor, rows: list[SamplingRow],
                   engine_processors: tuple[LogitsProcessor, ...] = ()
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(processed, raw) float32 [B, V] log-probs for beam search, as `transformers` scores beams:
    the logits processors run on log_softmax(logits), not on the logits."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    needs_processing = any(row.has_processors or row.suppresses_stop for row in rows)
    return (process_logits(raw, rows, None, engine_processors) if needs_processing else raw), raw


def warp_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for sampling rows; greedy rows pass through unchanged.

    Removed tokens become -inf. Returns a new float32 tensor; the input is not modified.
    Semantics are HF's warpers with min_tokens_to_keep=1 (what `generate` uses for sampling):
    top-k keeps ties with the k-th value, top-p keeps the smallest set whose mass reaches top_p
    (and at least the best token), min-p keeps tokens with prob >= min_p * max prob.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"expected logits [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
    vocab_size = logits.shape[1]
    device = logits.device
    # Neutral settings for greedy rows (temperature 1, no filters) keep the code branch-free.
    params = []
    for row in rows:
        c = row.config
        if c.greedy:
            params.append((1.0, 0.0, 1.0, 0.0))
        else:
            params.append((float(c.temperature), float(min(c.top_k, vocab_size)), float(c.top_p),
                           float(c.min_p)))
    # One host-to-device copy for all per-row parameters.
    p = to_device(params, torch.float32, device)
    temperature, top_k, top_p, min_p = p[:, 0:1], p[:, 1:2], p[:, 2:3], p[:, 3:4]
    use_temp = any(t != 1.0 for t, _, _, _ in params)
    use_top_k = any(k > 0 for _, k, _, _ in params)
    use_top_p = any(tp < 1.0 for _, _, tp, _ in params)
    use_min_p = any(mp > 0.0 for _, _, _, mp in params)

    out = logits.to(torch.float32)
    if use_temp:
        out = out / temperature
    elif out is logits:
        out = out.clone()  # later steps work in place on our own copy

    if use_top_k or use_top_p:
        # One ascending sort serves both, like HF's TopPLogitsWarper (ascending cumsum).
        sorted_logits, sorted_idx = torch.sort(out, dim=-1, descending=False)
        remove_sorted = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if use_top_k:
            # The k-th largest value sits at ascending position V - k; k = 0 means "off", which
            # position 0 (the minimum) expresses naturally: nothing is strictly below it.
            k = top_k.to(torch.int64)
            pos = torch.where(k > 0, vocab_size - k, torch.zeros_like(k))
            threshold = sorted_logits.gather(1, pos)
            remove_sorted |= sorted_logits < threshold
        if use_top_p:
            masked = sorted_logits.masked_fill(remove_sorted, float("-inf"))
            cumulative = masked.softmax(dim=-1).cumsum(dim=-1)
            top_p_remove = (cumulative <= (1 - top_p)) & (top_p < 1.0)
            top_p_remove[:, -1] = False  # keep at least the most likely token
            remove_sorted |= top_p_remove
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        out.masked_fill_(remove, float("-inf"))

    if use_min_p:
        probs = out.softmax(dim=-1)
        top_probs = probs.amax(dim=-1, keepdim=True)
        # min_p <= 1, so the top token always survives (min_tokens_to_keep=1 for free).
        out.masked_fill_(probs < min_p * top_probs, float("-inf"))
    return out


class Sampler:
    """Chooses the next token for a batch of requests with heterogeneous settings.

    Rows without their own draws (unseeded requests) share a generator owned by the Sampler
    (one per device, created lazily), seeded with `seed` when given so an engine run is
    reproducible as a whole.
    """

    def __init__(self, seed: int | None = None,
                 logits_processors: tuple[LogitsProcessor, ...] = (),
                 logprobs_mode: str = "raw_logprobs") -> None:
        self._seed = seed
        # What sample log-probs report (`runner.logprobs_mode`).
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)
        # Engine-wide processors, in the order they run (`process_logits`), and those greedy
        # rows skip (asked once: `build_logits_processors` made sure the answer comes).
        self.logits_processors = tuple(logits_processors)
        self._greedy_skipping = tuple(p for p in self.logits_processors
                                      if p.is_argmax_invariant())
        self._generators: dict[torch.device, torch.Generator] = {}
        self._histories: dict[tuple[torch.device, int], TokenHistories] = {}

    def token_histories(self, device: torch.device, vocab_size: int) -> TokenHistories:
        """The token ids of the rows sampled on `device` whose processors read them (made on
        first use)."""
        key = (device, vocab_size)
        histories = self._histories.get(key)
        if histories is None:
            histories = self._histories[key] = TokenHistories(vocab_size, device)
        return histories

    def release(self, row: SamplingRow) -> None:
        """`row` will not be sampled again: free what the sampler keeps for it."""
        if row.uses_token_history:
            for histories in self._histories.values():
                histories.release(row)
        for processor in row.engine_processors:
            try:
                processor.release(row.view)
            except BaseException:  # noqa: BLE001 - user code: the row is gone either way
                logger.exception("logits processor %s failed to release request %s",
                                 type(processor).__name__, row.request_id)

    def default_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed % (1 << 64))
            self._generators[device] = generator
        return generator

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """One token per row from logits [B, V] (any float dtype); see the module docstring."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"expected logits [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        want_logprobs = [row.config.logprobs or 0 for row in rows if row.wants_logprob]
        all_greedy = all(row.config.greedy for row in rows)
        needs_processing = any(row.has_processors or row.suppresses_stop for row in rows)
        # Log-probs stay those of the raw model distribution, grammar or not.
        raw_logits = logits
        logits = apply_grammar_masks(logits, rows)

        if all_greedy and not needs_processing and not want_logprobs:
            # Fast path: argmax is exact on the native dtype (float32 widening is monotone).
            return SamplerOutput(token_ids=logits.argmax(dim=-1))

        tracked = [i for i, row in enumerate(rows) if row.uses_token_history]
        histories = self.token_histories(logits.device, logits.shape[1]) if tracked else None
        processed = (process_logits(logits, rows, histories, self.logits_processors,
                                    self._greedy_skipping)
                     if needs_processing else logits.float())
        if needs_processing and logits is not raw_logits:
            processed = keep_grammar_choices(remask_grammar_rows(processed, logits, rows), logits)
        greedy_ids = processed.argmax(dim=-1)
        # The logits each row's token is chosen from (greedy rows: the processed ones).
        final = processed
        if all_greedy:
            token_ids = greedy_ids
        else:
            final = warp_logits(processed, rows)
            sampled = self.sample_rows(final, rows)
            greedy_mask = to_device([row.config.greedy for row in rows], torch.bool, logits.device)
            token_ids = torch.where(greedy_mask, greedy_ids, sampled)
        if histories is not None:
            histories.record(histories.slots([rows[i] for i in tracked]), tracked, token_ids)

        if not want_logprobs:
            return SamplerOutput(token_ids=token_ids)
        raw = reported_values(self.logprobs_mode, raw_logits, final)
        chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        ranks = chosen_ranks(raw, chosen)
        k_max = max(want_logprobs)
        if k_max > 0:
            values, ids = torch.topk(raw, min(k_max, raw.shape[1]), dim=-1)
        else:
            values = raw.new_empty((raw.shape[0], 0))
            ids = token_ids.new_empty((raw.shape[0], 0))
        return SamplerOutput(token_ids=token_ids, logprobs=chosen, ranks=ranks,
                             top_logprobs=(values, ids))

    def sample_rows(self, warped: torch.Tensor, rows: list[SamplingRow],
                    ahead: list[int] | None = None) -> torch.Tensor:
        """Exponential race on warped logits: argmax(probs / E) ~ Categorical(probs).

        Seeded rows draw exactly V exponentials from their draws' generator seeded for the
        output position they decide: len(output_token_ids), plus `ahead[i]` for row i (draft
        verification decides several positions of a sequence at once). Greedy rows get E = 1
        (their result is replaced by the argmax anyway) so they do not consume the shared
        generator.
        """
        probs = warped.softmax(dim=-1)
        batch = len(rows)
        shared = [i for i, row in enumerate(rows)
                  if not row.config.greedy and row.draws is None]
        seeded = [i for i, row in enumerate(rows)
                  if not row.config.greedy and row.draws is not None]
        noise = torch.empty_like(probs)
        default = self.default_generator(probs.device)
        if len(shared) == batch:
            noise.exponential_(generator=default)
        else:
            noise.fill_(1.0)
            if shared:
                draws = torch.empty((len(shared), probs.shape[1]), dtype=probs.dtype,
                                    device=probs.device).exponential_(generator=default)
                noise.index_copy_(0, to_device(shared, torch.int64, probs.device), draws)
            for i in seeded:
                row = rows[i]
                position = len(row.output_token_ids) + (ahead[i] if ahead else 0)
                noise[i].exponential_(generator=row.draws.at(position))
        # A zero draw would turn a removed token's 0 probability into 0/0 = NaN; clamp it away.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)
