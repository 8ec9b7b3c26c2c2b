"""Per-request state inside the engine core: tokens, progress, blocks, status."""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ksana_llm.generation_config import GenerationConfig


# Stands in a sequence's token list for a sampled token the host does not know yet (async
# scheduling: the next step is planned, and launched, before the previous step's tokens are read
# back; the device feeds those tokens to it directly).
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"


@dataclass(frozen=True)
class ForwardSpec:
    """What a forward-only sequence captures (no sampling; it finishes once its prompt is computed).

    `positions`: sorted, unique prompt positions whose rows to keep. `logits`: keep their final
    logits rows (float32); `hidden`: keep their last hidden state (after the final norm).
    A forward-only sequence never adopts prefix-cache blocks (every token is recomputed), though it
    publishes its own full blocks like any other sequence.
    """

    positions: tuple[int, ...]
    logits: bool = True
    hidden: bool = False


@dataclass(eq=False)
class Sequence:
    """One sequence being generated.

    Invariant: `num_computed_tokens <= len(token_ids)`; the KV of the first `num_computed_tokens`
    tokens lives in `block_table` (or in `host_block_table` while swapped out).
    """

    request_id: str
    prompt_token_ids: list[int]
    config: GenerationConfig
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    rank: float = 0.0  # the scheduling policy's, set when the scheduler takes the sequence
    arrival_time: float = field(default_factory=time.monotonic)
    admission_order: int = 0  # set by the scheduler; breaks ties between equal arrival times
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens not computed here (prefix cache or imported KV)
    # How far the engine's prompt-token count has taken this prompt: chunks count as they are
    # computed, a recompute after preemption adds nothing.
    num_prompt_tokens_counted: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    draws: Any = None  # a seeded sequence's SeededDraws (runner.sampler), on the runner's device
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    # Timing for metrics: set by the engine core.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Block hashes of this sequence's full blocks, in order (prefix-cache chain).
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already published in the prefix cache
    # Forward-only requests: what to capture, and the rows captured so far, keyed by position
    # (keyed, so a recompute after preemption overwrites rather than duplicates).
    forward: ForwardSpec | None = None
    forward_rows: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    # Several sequences per request (parallel sampling, beam search): the request's group, this
    # sequence's index in it (stable; the order of creation) and the slots it reserves at
    # admission (the whole group's width for the request's first sequence, 1 otherwise).
    group: SequenceGroup | None = None
    index: int = 0
    num_reserved_slots: int = 1
    cumulative_logprob: float = 0.0  # sum of the chosen tokens' raw log-probs, when computed
    matcher: Any = None  # structured output: a ksana_llm.structured GrammarMatcher
    detokenizer: Any = None  # its IncrementalDetokenizer (set by the engine core)
    # Plugin input embeddings replacing token embeddings at some prompt positions:
    # (positions, [len(positions), hidden] tensor). Such a sequence never touches the prefix cache.
    embeddings: tuple[tuple[int, ...], Any] | None = None
    # The whole prompt was given as embeddings (`Request.prompt_embeds`): its token ids are
    # placeholders, which nothing may read as text or history (see `context_token_ids`).
    prompt_is_embeddings: bool = False
    # Prompt log-probs collected so far, keyed by the position of the token they score (>= 1).
    prompt_logprobs: dict[int, dict[str, Any]] | None = None
    text: str = ""  # output text so far, kept only when outputs are ranked at the end (best_of)
    sampling_row: Any = None  # its runner.sampler.SamplingRow, built at its first sample
    # Async scheduling: trailing output tokens sampled on the device but not yet read back (each
    # is PENDING_TOKEN in `output_token_ids`; at most 2, for one step in flight and the next).
    num_pending_tokens: int = 0
    # The sequence ends once it holds this many tokens (prompt + max_new_tokens, bounded by the
    # context); set by the engine core.
    max_num_tokens: int = sys.maxsize
    # Speculative decoding: tokens the draft layer proposes after the last one, verified (and
    # replaced) in the sequence's next decode step.
    draft_token_ids: list[int] = field(default_factory=list)
    # Prefill/decode disaggregation: KV of a prompt prefix computed by another engine (a
    # runner.kv_transfer.TransferredKv already cut to the usable prefix), written into this
    # sequence's blocks when it is admitted, and dropped then.
    imported_kv: Any = None
    kv_imported: bool = False  # its KV started from an import (kept after `imported_kv` is dropped)
    export_kv: bool = False  # copy the prompt's KV out when it finishes (single-sequence requests)
    # LoRA: its adapter (an engine-wide id, 0 = the base model); the device slot its tokens use
    # while admitted (set by the scheduler, see engine.lora_residency); and what its prefix-cache
    # chain starts from, so KV computed under one adapter is never served to another.
    lora_id: int = 0
    lora_slot: int = 0
    num_lora_waits: int = 0  # steps it was passed over because every slot was held
    lora_drain_target: int = 0  # the held adapter it waits to drain (see Scheduler)
    # Speculative decoding with the "ngram" method: its n-gram index (engine.ngram_proposer),
    # and a predicted output (OpenAI's Predicted Outputs) drafts are looked up in first.
    ngram_index: Any = None
    prediction: list[int] | None = None
    prediction_index: Any = None
    cache_salt: int | None = None
    # LongRoPE models: its KV is computed with the long factors, as it is longer than the
    # model's original context (set by the scheduler; see layers.rotary_longrope).
    long_rope: bool = False
    # The engine-wide logits processors (ksana_llm.LogitsProcessor) that apply to its request.
    engine_processors: tuple[Any, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def context_token_ids(self) -> list[int]:
        """The prompt's ids as penalties, n-gram bans, stop checks and the detokenizer see
        them: none for a prompt given as embeddings (as transformers' `generate(inputs_embeds=)`
        sees no prompt ids)."""
        return [] if self.prompt_is_embeddings else self.prompt_token_ids

    @property
    def samples_from_host_tokens(self) -> bool:
        """Whether sampling its next token reads its tokens on the host (a grammar matcher, the
        request's own logits processors, the engine's that apply to it): a step in flight must
        be read back first."""
        return (self.matcher is not None or bool(self.config.logits_processors)
                or bool(self.engine_processors))

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows (all but the pending ones)."""
        return self.num_tokens - self.num_pending_tokens

    @property
    def final_token_pending(self) -> bool:
        """Its last token is sampled but not read back: nothing more to compute (async)."""
        return self.num_pending_tokens > 0 and self.num_tokens >= self.max_num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether it may adopt cached blocks: not when every prompt row must be computed
        (forward-only, prompt log-probs) nor when its KV depends on more than its token ids."""
        return self.forward is None and self.prompt_logprobs is None and self.embeddings is None

    @property
    def fills_prefix_cache(self) -> bool:
        """Whether its full blocks may be published: the same tokens must mean the same KV. Not
        for KV imported from another engine: this engine cannot vouch for it, and a bad import
        must not reach other requests."""
        return self.embeddings is None and not self.kv_imported

    def fork(self, index: int) -> Sequence:
        """A new sequence with a copy of this one's tokens and sampling state (not its blocks nor
        its queue: `Scheduler.fork` does those). Its seeded draws and detokenizer are the
        caller's."""
        return Sequence(
            self.request_id, self.prompt_token_ids, self.config, eos_token_ids=self.eos_token_ids,
            priority=self.priority, rank=self.rank, arrival_time=self.arrival_time,
            admission_order=self.admission_order, output_token_ids=list(self.output_token_ids),
            status=self.status, num_cached_tokens=self.num_cached_tokens,
            logprobs=list(self.logprobs), first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time, num_preemptions=self.num_preemptions,
            group=self.group, index=index, cumulative_logprob=self.cumulative_logprob,
            matcher=self.matcher.fork() if self.matcher is not None else None,
            embeddings=self.embeddings, prompt_is_embeddings=self.prompt_is_embeddings,
            text=self.text, max_num_tokens=self.max_num_tokens,
            kv_imported=self.kv_imported, lora_id=self.lora_id, lora_slot=self.lora_slot,
            cache_salt=self.cache_salt, long_rope=self.long_rope, prediction=self.prediction,
            engine_processors=self.engine_processors)

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request.

    A request starts as one sequence. Once its prompt is computed it forks into
    `config.num_sequences` sequences sharing the prompt's blocks (parallel sampling, best_of), or
    it runs beam search, whose live beams are its sequences (`beam` holds the search state).
    `finished` keeps the sequences that ended, for outputs ranked at the end.
    """

    request_id: str
    config: GenerationConfig
    seqs: list[Sequence] = field(default_factory=list)  # live sequences
    finished: list[Sequence] = field(default_factory=list)
    beam: Any = None  # ksana_llm.engine.beam_search.BeamSearch for beam-search requests
    next_index: int = 1  # index of the next sequence forked
    forked: bool = False  # the prompt's sequence has forked (or needs no fork)
    # Prompt log-probs once complete (first entry None), and whether an output carried them.
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_logprobs_sent: bool = False
    # Prefill/decode disaggregation: the prompt's KV exported when the request finished (a
    # runner.kv_transfer.TransferredKv, see Sequence.export_kv); it rides on the last output.
    exported_kv: Any = None
