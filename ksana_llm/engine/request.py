"""Per-request state inside the engine core: tokens, progress, blocks, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ksana_llm.generation_config import GenerationConfig


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
    arrival_time: float = field(default_factory=time.monotonic)
    admission_order: int = 0  # set by the scheduler; breaks ties between equal arrival times
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    generator: Any = None  # torch.Generator for seeded sampling (owned by the runner's device)
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

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while tokens other than the last sampled one still lack KV."""
        return self.num_tokens - self.num_computed_tokens > 1

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
