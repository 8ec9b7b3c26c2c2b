"""Token-budget continuous batching with chunked prefill and preemption.

There is no prefill phase and no decode phase: each sequence tracks `num_computed_tokens`, and
every step hands out at most `max_step_tokens` tokens so that it catches up with `num_tokens`.
Running sequences are served first (a decode costs 1 token, plus its drafts under speculative
decoding; a prefill chunk up to the rest of the budget), then swapped-out sequences come back,
then waiting ones are admitted. Every queue is kept in the order of the scheduling policy
(`engine.scheduling_policy`: a rank per request, then arrival). When the KV pool runs out, the
last running sequence in that order is preempted: swapped to the host pool (`preempt_mode=0`) or
freed to be recomputed later (`preempt_mode=1`). Under a preemptive policy ("priority") a waiting
request that cannot start also preempts running sequences of a larger rank, and is admitted
before swapped-out ones of a larger rank.

Sequences of one request (parallel samples, beams) are scheduled one by one like any other: they
share blocks by refcount, and the block manager copies a shared block before anyone writes to it.
With async scheduling a step is planned before the previous step's tokens are known: a sequence
then holds pending tokens (`Sequence.num_pending_tokens`) that count like any other, except that
one whose pending token is its last is not scheduled again.
A running sequence with nothing to compute (a beam waiting for its siblings' logits) is skipped;
if such idle sequences hold the blocks that everything else waits for, the last one is preempted
for recompute so the others can move (see `schedule`), and a sequence that runs short of blocks
with no less urgent one to preempt takes an idle one's before giving up its own.

LongRoPE models (`long_rope_switch`) follow transformers: a sequence longer than the original
context is computed with the long factors throughout (`Sequence.long_rope`, decided when it is
admitted), and a running sequence that grows past that length goes back to the waiting queue to
be recomputed with them, whatever KV it holds (not a preemption: nothing ran short; preempted at
that moment, it is recomputed rather than swapped out). Its drafts stop short of that length,
so no row past it is computed with the short factors.
"""

from __future__ import annotations

import bisect

from ksana_llm.engine.adapter_admission import AdapterAdmission
from ksana_llm.engine.kv_cache import BlockManager, PrefixMatch
from ksana_llm.engine.lora_residency import LoraResidency
from ksana_llm.engine.request import Sequence, SequenceStatus
from ksana_llm.engine.scheduler_records import (QueueFullError, ScheduledSequence,
                                                SchedulerConfig, SchedulerOutput)
from ksana_llm.engine.scheduling_policy import RequestInfo, resolve_scheduling_policy


class Scheduler(AdapterAdmission):
    """Decides, step by step, which sequences run and how many tokens each computes."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.policy = resolve_scheduling_policy(config.policy)
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # ordered by policy key
        self.running: list[Sequence] = []  # ordered by policy key
        self.swapped: list[Sequence] = []  # ordered by policy key
        self._admissions = 0  # FIFO tie-breaker that survives preemption
        self.num_preemptions = 0
        self.num_long_rope_recomputes = 0  # sequences recomputed as they outgrew the short factors
        # The last step left requests waiting for KV memory (see `schedule`).
        self.waiting_blocked = False
        self.num_imported_kv_tokens = 0  # prompt tokens whose KV another engine computed
        self.lora = LoraResidency(config.max_loras) if config.max_loras else None
        self.num_lora_loads = 0  # adapters copied into a device slot

    # ---- queue management ----------------------------------------------------------------
    @staticmethod
    def _key(seq: Sequence) -> tuple[float, float, int]:
        return (seq.rank, seq.arrival_time, seq.admission_order)

    def _insert(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self._key)

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_queue_size:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_queue_size} requests); retry later")
        seq.rank = self.policy.rank_of(RequestInfo(
            seq.request_id, seq.priority, seq.arrival_time, seq.num_prompt_tokens,
            seq.config.max_new_tokens, seq.num_reserved_slots))
        seq.admission_order = self._admissions
        self._admissions += 1
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, seq)

    def expire_waiting(self, deadline: float) -> list[Sequence]:
        """Take out the waiting sequences that arrived before `deadline` and never ran (a
        preempted sequence waiting to resume is not expired: it already holds the user's output)."""
        expired = [s for s in self.waiting
                   if s.arrival_time < deadline and s.first_scheduled_time is None]
        for seq in expired:
            self.waiting.remove(seq)
        return expired

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Queue `child`, which holds a copy of `parent`'s tokens, next to the parent: sharing its
        blocks when the parent is running, otherwise (waiting or swapped out) to be recomputed."""
        child.priority, child.rank = parent.priority, parent.rank
        child.arrival_time = parent.arrival_time
        child.admission_order = parent.admission_order
        if parent.status == SequenceStatus.RUNNING:
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self._insert(self.running, child)
        else:
            child.block_table, child.num_computed_tokens = [], 0
            child.block_hashes, child.num_registered_blocks = [], 0
            child.status = SequenceStatus.WAITING
            self._insert(self.waiting, child)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it and release its blocks."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self._release_adapter(seq)
        self.block_manager.free(seq)
        self.block_manager.free_host(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- one step ------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, budget: int, num_computed: int) -> int:
        num_new = min(seq.num_tokens - num_computed, budget)
        if self.config.split_fuse_token_num:
            num_new = min(num_new, self.config.split_fuse_token_num)
        return num_new

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_step_tokens
        made_room = self._preempt_for_urgent_waiting(out)
        budget = self._schedule_running(out, budget)
        # A step whose running sequences ran out of blocks admits nobody (it would only take the
        # blocks they need next); room made for an urgent request is taken by it at once.
        pressed = len(out.preempted) > made_room
        urgent = self._waiting_outranks_swapped()
        if not pressed and not urgent:
            budget = self._schedule_swapped(out, budget)
        # Whether waiting requests stay waiting for memory (not for budget): a free sequence slot
        # is then no place for them (admission control counts them as queued).
        self.waiting_blocked = bool(self.waiting) and (pressed or bool(self.swapped and not urgent))
        if not pressed and (not self.swapped or urgent):
            self._schedule_waiting(out, budget)
        if out.is_empty and not out.preempted and (self.waiting or self.swapped):
            # Idle sequences never allocate, so nothing above preempts them; if they hold the
            # blocks the others wait for, free the last one (recompute: swapping it back in would
            # just take the same blocks again).
            idle = self._last_idle(self.running)
            if idle is not None:
                self.running.remove(idle)
                self._preempt(idle, out, recompute=True)
        out.copy_blocks = self.block_manager.take_copies()
        out.fresh_blocks = self.block_manager.take_fresh_blocks()
        if self.lora is not None:
            out.lora_loads = self.lora.take_loads()
            self.num_lora_loads += len(out.lora_loads)
        return out

    def _preempt_for_urgent_waiting(self, out: SchedulerOutput) -> int:
        """Preemptive policy (vLLM's priority preemption): while the most urgent waiting request
        cannot start for want of a sequence slot or blocks, running sequences of a strictly larger
        rank (a lower priority) are preempted for it, least urgent first. Returns how many.

        Strictly larger, not a later arrival of the same rank: a request that was preempted
        itself and waits again must not push out its equals, which would then push it out."""
        if not self.policy.preemptive or not self.waiting:
            return 0
        head = self.waiting[0]
        if head.lora_id and (self.lora is None
                             or not self.lora.can_place(head.lora_id, self._held_adapters())):
            return 0  # it waits for an adapter slot, which preempting others does not give it
        count = 0
        while self.running and self.running[-1].rank > head.rank \
                and not self._could_start(head):
            self._preempt(self.running.pop(), out)
            count += 1
        return count

    def _could_start(self, seq: Sequence) -> bool:
        """Whether a waiting sequence has a slot, and free blocks for its prompt's first chunk
        (those the running sequences take this step aside: if they then run short, the usual
        preemption goes on from the least urgent)."""
        if self._num_reserved_running() + seq.num_reserved_slots > self.config.max_num_seqs:
            return False
        bm = self.block_manager
        self._settle_long_rope(seq)
        prefix = bm.match_prefix(seq)
        first = self._chunk(seq, self.config.max_step_tokens, prefix.num_tokens)
        needed = bm.blocks_needed(prefix.num_tokens + first) - len(prefix.block_ids)
        revived = sum(1 for b in prefix.block_ids if bm.ref_counts[b] == 0)  # leave the free queue
        return needed + revived <= bm.num_free_blocks

    def _waiting_outranks_swapped(self) -> bool:
        """Preemptive policy: the most urgent waiting request is more urgent than every swapped-out
        sequence, so it is admitted before they come back (else swapped-out work goes first)."""
        return (self.policy.preemptive and bool(self.waiting) and bool(self.swapped)
                and self.waiting[0].rank < self.swapped[0].rank)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = list(self.running)
        still_running: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            if budget <= 0 or seq.num_computed_tokens >= seq.num_tokens or seq.final_token_pending:
                # Out of budget, or idle: nothing to compute, or (async scheduling) its last
                # token is still on its way back and ends it.
                still_running.append(seq)
                continue
            if self._outgrew_short_rope(seq):
                if not seq.num_pending_tokens:  # (else once its tokens are known)
                    self._requeue_for_recompute(seq)
                    self.num_long_rope_recomputes += 1
                else:
                    still_running.append(seq)
                continue
            num_new = self._chunk(seq, budget, seq.num_computed_tokens)
            while not self.block_manager.allocate(seq, num_new):
                # Out of blocks: preempt the least urgent sequence; past this one, an idle one
                # (a beam waiting for its siblings: were this one to give way instead, the
                # siblings could take turns at the blocks it holds forever), else this one.
                idle = None if queue else self._last_idle(still_running)
                if idle is not None:
                    still_running.remove(idle)
                    self._preempt(idle, out, recompute=True)
                    continue
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, num_new))
                still_running.append(seq)
                budget -= num_new
        self.running = still_running
        if not out.preempted and not self.swapped:
            budget = self._add_drafts(out, budget)
        return budget

    @staticmethod
    def _last_idle(seqs: list[Sequence]) -> Sequence | None:
        """The last of `seqs` with nothing to compute (its rows kept: a beam's log-probs still
        count for its group's step once it is preempted and recomputed)."""
        return next((s for s in reversed(seqs) if s.num_computed_tokens >= s.num_tokens), None)

    def speculation_paused(self, batch_size: int) -> bool:
        """Whether a step of batch_size sequences goes without drafts."""
        limit = self.config.speculative_disable_by_batch_size
        return limit is not None and batch_size >= limit

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Speculative decoding: once every running sequence has its tokens and blocks, decodes
        take their drafts along as far as the budget and the free blocks go. Drafts never
        preempt anyone, and wait while anything is preempted or swapped out (they would hold
        back the blocks a swap-in, and then new admissions, need), and in steps of
        `speculative_disable_by_batch_size` sequences or more."""
        if self.speculation_paused(len(out.scheduled)):
            return budget
        for item in out.scheduled:
            seq = item.seq
            if budget <= 0:
                break
            if not seq.draft_token_ids or item.num_new_tokens != 1 \
                    or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            num_drafts = min(len(seq.draft_token_ids), budget)
            if self.config.long_rope_switch is not None and not seq.long_rope:
                num_drafts = min(num_drafts, self.config.long_rope_switch - seq.num_tokens)
            if num_drafts > 0 and self.block_manager.allocate(seq, 1 + num_drafts):
                item.num_new_tokens += num_drafts
                item.num_draft_tokens = num_drafts
                budget -= num_drafts
        return budget

    def _num_reserved_running(self) -> int:
        """Sequence slots the running requests hold: a request of n samples or beams that has
        not forked yet is one sequence holding n slots (its children join `running` without
        another admission, so they must fit under max_num_seqs already)."""
        return sum(seq.num_reserved_slots for seq in self.running)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        reserved = self._num_reserved_running()
        while self.swapped and budget > 0 and (
                reserved + self.swapped[0].num_reserved_slots <= self.config.max_num_seqs
                or not self.running):
            seq = self.swapped[0]
            num_new = self._chunk(seq, budget, seq.num_computed_tokens)
            mapping = self.block_manager.swap_in(seq, num_new)
            if mapping is None:
                break
            self.swapped.pop(0)
            out.swap_in.extend(mapping)
            seq.status = SequenceStatus.RUNNING
            self._insert(self.running, seq)
            reserved += seq.num_reserved_slots
            if num_new:  # an idle sequence comes back with nothing to compute
                out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        held: dict[int, int] | None = None  # adapter -> its running and swapped-out sequences
        # Adapters that take no newer requests this step, so that a slot frees up for a request
        # that waited too long for one (see `_adapter_admissible`).
        draining: set[int] = set()
        reserved = self._num_reserved_running()
        i = 0
        while i < len(self.waiting) and budget > 0 and (
                reserved + self.waiting[i].num_reserved_slots <= self.config.max_num_seqs
                or not self.running):
            seq = self.waiting[i]
            if seq.lora_id:
                if held is None:
                    held = self._held_adapters()
                if not self._adapter_admissible(seq, held, draining):
                    i += 1  # it waits for a slot, and those behind it may go
                    continue
            # Forward-only, prompt-logprob and embedding sequences get no prefix-cache hits.
            self._settle_long_rope(seq)
            prefix = bm.match_prefix(seq)
            imported = seq.imported_kv
            if imported is not None and imported.long_rope != seq.long_rope:
                imported = None  # KV of LongRoPE's other factor set: recomputed here
            if imported is not None and imported.num_tokens > prefix.num_tokens:
                # KV from another engine covers more than the cache: fresh blocks, filled with it.
                num_new = self._chunk(seq, budget, imported.num_tokens)
                if not bm.allocate(seq, imported.num_tokens + num_new):
                    self.waiting_blocked = True
                    break
                out.kv_imports.append((list(seq.block_table), imported))
                seq.kv_imported = True
                self.num_imported_kv_tokens += imported.num_tokens
                prefix, start = PrefixMatch([], 0), imported.num_tokens
            else:
                num_new = self._chunk(seq, budget, prefix.num_tokens)
                if not bm.allocate(seq, num_new, prefix):
                    self.waiting_blocked = True
                    break
                start = prefix.num_tokens
            seq.imported_kv = None  # written now, or not needed; a recompute computes it all
            self.waiting.pop(i)
            seq.num_computed_tokens = start
            if seq.num_preemptions == 0 and not seq.output_token_ids:
                # First admitted (a preempted or LongRoPE-recomputed sequence has tokens out).
                # Prompt tokens not computed here: prefix-cache hits, or KV imported from a
                # prefill engine (vLLM counts a KV connector's tokens as cached too).
                seq.num_cached_tokens = start
                if bm.enable_prefix_caching and seq.uses_prefix_cache and not seq.kv_imported:
                    bm.record_prefix_lookup(seq.num_tokens, prefix.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self._insert(self.running, seq)
            reserved += seq.num_reserved_slots
            if seq.lora_id:
                # Placed only now that it has its blocks: a request that cannot start yet
                # moves no adapter out of its slot.
                seq.lora_slot = self.lora.place(seq.lora_id, held)
                seq.num_lora_waits, seq.lora_drain_target = 0, 0
                held[seq.lora_id] = held.get(seq.lora_id, 0) + 1
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput, recompute: bool = False) -> None:
        self.num_preemptions += 1
        seq.num_preemptions += 1
        out.preempted.append(seq)
        # A sequence that just outgrew LongRoPE's short factors is recomputed anyway: its KV
        # is not worth a swap (and a swap-in would decode on it).
        if self.config.preempt_mode == 0 and not recompute and not self._outgrew_short_rope(seq):
            mapping = self.block_manager.swap_out(seq)
            if mapping is not None:
                out.swap_out.extend(mapping)
                seq.status = SequenceStatus.SWAPPED
                self._insert(self.swapped, seq)
                return
        self._requeue_for_recompute(seq)  # recompute (or the host pool is full)

    def _requeue_for_recompute(self, seq: Sequence) -> None:
        """Drop the sequence's KV and put it back in the waiting queue, tokens kept."""
        self._release_adapter(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.kv_imported = False  # all computed here from now on
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, seq)

    # ---- LongRoPE ---------------------------------------------------------------------------
    def _settle_long_rope(self, seq: Sequence) -> None:
        """A sequence about to be computed from its start takes the long factors when it is
        longer than the original context; its prefix-cache chain then starts over (KV computed
        with the other factors must not serve it)."""
        switch = self.config.long_rope_switch
        if switch is not None and not seq.long_rope and seq.num_tokens > switch:
            seq.long_rope = True
            seq.block_hashes = []

    def _outgrew_short_rope(self, seq: Sequence) -> bool:
        """A running sequence computed with the short factors has grown past the switch."""
        switch = self.config.long_rope_switch
        return switch is not None and not seq.long_rope and seq.num_tokens > switch

    def finish(self, seq: Sequence) -> None:
        """A sequence is done: release everything it holds."""
        self.remove(seq)
        seq.status = SequenceStatus.FINISHED
