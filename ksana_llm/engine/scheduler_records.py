"""The scheduler's records: its settings, what one step runs, and the errors a request can
meet while it waits (a full queue, a timeout)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ksana_llm.engine.request import Sequence
from ksana_llm.engine.scheduling_policy import SchedulingPolicy


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_queue_size` requests already; try again later."""


class QueueTimeoutError(TimeoutError):
    """A request waited longer than `waiting_timeout_ms` without being scheduled."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_step_tokens: int = 2048
    max_num_seqs: int = 256
    split_fuse_token_num: int = 0  # 0: a prefill chunk is bounded by the budget only
    preempt_mode: Literal[0, 1] = 0  # 0 = swap, 1 = recompute
    # "fifo", "priority", an import path or a SchedulingPolicy (see engine.scheduling_policy).
    policy: str | SchedulingPolicy = "fifo"
    max_queue_size: int = 1000
    max_loras: int = 0  # LoRA adapter slots: the most distinct adapters running at once
    # Steps a request may wait for a LoRA slot while newer requests of the adapters holding the
    # slots go ahead; then those adapters drain (see `_schedule_waiting`). None: never drain.
    lora_max_wait_steps: int | None = 64
    # Speculative decoding: steps running at least this many sequences carry no drafts.
    speculative_disable_by_batch_size: int | None = None
    # LongRoPE models: the original context, past which a sequence takes the long factors (the
    # model's `long_rope_switch`; see Scheduler). None for every other model.
    long_rope_switch: int | None = None


@dataclass(slots=True)  # built per sequence per step: not frozen, which costs more to build
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens whose KV this step computes, starting at num_computed_tokens
    num_draft_tokens: int = 0  # the last ones of them are the sequence's drafts, to verify


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # (source, destination) device blocks: copy-on-write of blocks shared with a fork. Safe to run
    # after the swaps: a victim is never a sequence that allocated this step, and swap-ins only
    # happen in steps that preempt nothing, so no source or destination changes hands before.
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Device blocks given to sequences this step, to clear before anything is written to them
    # (`BlockManager.take_fresh_blocks`): after the swap-outs, before the swap-ins and copies.
    fresh_blocks: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Admitted sequences whose first positions come from another engine's KV (their block
    # tables now, and the KV to write there before the forward).
    kv_imports: list[tuple[list[int], Any]] = field(default_factory=list)
    # (slot, adapter id): LoRA adapters to copy into their device slots before the forward.
    lora_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
