"""Scheduler preemption: recompute and swap, the victim each policy picks, and forked sequences
(parallel sampling, beam search) sharing, copying and giving back blocks.

Expected values are derived from the algorithm in `ksana_llm/engine/scheduler.py`: running
sequences first (in policy order), then swapped ones, then waiting ones; a preemption victim is
the last running sequence not yet scheduled this step (or the one being scheduled). Steps run
without a model: `tests/scheduler_harness.py`'s `step()`.
"""

from __future__ import annotations


from ksana_llm.engine.request import SequenceStatus
from tests.scheduler_harness import (ids, make_scheduler, make_seq, plan, sampled_token,
                                     step)


# ---- preemption: recompute -----------------------------------------------------------------
def test_recompute_preempts_last_running_and_requeues_it_at_front():
    # 4 blocks of 4: a, b, c take one block each for 4-token prompts, leaving 1.
    sched = make_scheduler(num_blocks=4, max_step_tokens=100, preempt_mode=1)
    bm = sched.block_manager
    a, b, c = make_seq("a", 4), make_seq("b", 4), make_seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched)) == [("a", 4), ("b", 4), ("c", 4)]
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    d = make_seq("d", 4)
    sched.add(d)

    # Each decode needs a second block. a gets block 3; b finds none, so c (the last running
    # sequence) is preempted: its cached block 2 is freed and immediately taken by b.
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert out.preempted == [c] and out.swap_out == [] and out.swap_in == []
    assert (a.block_table, b.block_table, c.block_table) == ([0, 3], [1, 2], [])
    assert c.status == SequenceStatus.WAITING
    assert c.num_computed_tokens == 0
    assert c.num_tokens == 5  # its sampled token is kept
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    # Back at the front of the waiting queue, ahead of d which arrived later; no admission
    # happens in a step that preempted.
    assert ids(sched.waiting) == ["c", "d"]
    assert ids(sched.running) == ["a", "b"]
    assert list(bm.free_queue) == []
    # c's block 2 was evicted when b reused it: its prefix is gone.
    assert bm.block_key[2] is None and c.block_hashes[0] not in bm.cached_blocks

    # No room for c yet: running sequences keep decoding.
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert out.preempted == []
    assert ids(sched.waiting) == ["c", "d"]

    sched.finish(a)
    # a's tail block 3 (2 tokens, uncached) to the front, cached block 0 to the back.
    assert list(bm.free_queue) == [3, 0]
    # c recomputes everything it had: 4 prompt tokens + 1 sampled token.
    out = step(sched)
    assert plan(out) == [("b", 1), ("c", 5)]
    assert c.block_table == [3, 0]
    assert c.num_cached_tokens == 0
    assert ids(sched.waiting) == ["d"]


def test_recompute_reuses_its_own_cached_prefix():
    sched = make_scheduler(num_blocks=5, max_step_tokens=100, preempt_mode=1)
    bm = sched.block_manager
    a, b = make_seq("a", 8), make_seq("b", 8)
    sched.add(a)
    sched.add(b)
    assert plan(step(sched)) == [("a", 8), ("b", 8)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])

    # a takes the last block; b is the last running sequence and preempts itself.
    out = step(sched)
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert a.block_table == [0, 1, 4]
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert list(bm.free_queue) == [3, 2]  # b's cached blocks, tail first

    sched.finish(a)
    assert list(bm.free_queue) == [4, 3, 2, 1, 0]
    # b (8 prompt + 1 sampled token) finds both its blocks still cached: computes 1 token.
    out = step(sched)
    assert plan(out) == [("b", 1)]
    assert b.block_table == [2, 3, 4]
    assert b.num_computed_tokens == 9
    assert b.num_cached_tokens == 0  # only the first admission records cache hits


# ---- preemption: swap ----------------------------------------------------------------------
def test_swap_preemption_and_swap_in_before_new_admissions():
    sched = make_scheduler(num_blocks=5, num_host_blocks=4, max_step_tokens=100, preempt_mode=0)
    bm = sched.block_manager
    a, b = make_seq("a", 8), make_seq("b", 8)
    sched.add(a)
    sched.add(b)
    assert plan(step(sched)) == [("a", 8), ("b", 8)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])

    out = step(sched)
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert out.swap_out == [(2, 0), (3, 1)]
    assert b.status == SequenceStatus.SWAPPED
    assert b.host_block_table == [0, 1] and b.block_table == []
    assert b.num_computed_tokens == 8  # the KV is kept on the host
    assert ids(sched.swapped) == ["b"] and sched.waiting == []
    assert bm.free_host_blocks == [3, 2]
    assert list(bm.free_queue) == [3, 2]
    assert a.block_table == [0, 1, 4]

    # A new request would fit (1 block, 2 free), but b needs 3 blocks to come back and
    # swapped sequences go first: nothing is admitted.
    c = make_seq("c", 4)
    sched.add(c)
    out = step(sched)
    assert plan(out) == [("a", 1)]
    assert out.swap_in == [] and out.preempted == []
    assert ids(sched.swapped) == ["b"] and ids(sched.waiting) == ["c"]

    sched.finish(a)
    assert list(bm.free_queue) == [4, 3, 2, 1, 0]
    out = step(sched)
    # b comes back first: host 0 -> device 4, host 1 -> device 3 (third block for its new token),
    # and computes only its 1 new token; then c is admitted into the next free block.
    assert out.swap_in == [(0, 4), (1, 3)]
    assert plan(out) == [("b", 1), ("c", 4)]
    assert b.block_table == [4, 3, 2]
    assert c.block_table == [1]
    assert b.host_block_table == []
    assert bm.free_host_blocks == [3, 2, 1, 0]
    assert b.status == c.status == SequenceStatus.RUNNING
    assert ids(sched.running) == ["b", "c"] and sched.swapped == []
    assert b.num_preemptions == 1 and sched.num_preemptions == 1


def test_swap_falls_back_to_recompute_when_host_pool_is_full():
    sched = make_scheduler(num_blocks=5, num_host_blocks=1, max_step_tokens=100, preempt_mode=0)
    a, b = make_seq("a", 8), make_seq("b", 8)
    sched.add(a)
    sched.add(b)
    step(sched)
    out = step(sched)
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b] and out.swap_out == []
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert ids(sched.waiting) == ["b"] and sched.swapped == []
    assert sched.block_manager.free_host_blocks == [0]


def test_swap_in_resumes_a_chunked_prefill():
    sched = make_scheduler(num_blocks=5, num_host_blocks=4, max_step_tokens=100, preempt_mode=0,
                           split_fuse_token_num=4)
    bm = sched.block_manager
    a, b = make_seq("a", 8), make_seq("b", 12)
    sched.add(a)
    sched.add(b)
    assert plan(step(sched)) == [("a", 4), ("b", 4)]
    assert plan(step(sched)) == [("a", 4), ("b", 4)]
    assert (a.block_table, b.block_table) == ([0, 2], [1, 3])

    # a's decode takes the last free block; b's next chunk needs a third block: b swaps out
    # with 8 of its 12 prompt tokens computed.
    out = step(sched)
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b] and out.swap_out == [(1, 0), (3, 1)]
    assert b.num_computed_tokens == 8

    sched.finish(a)
    assert list(bm.free_queue) == [4, 3, 1, 2, 0]
    out = step(sched)
    # Back in with room for a split_fuse-sized chunk: the last 4 prompt tokens.
    assert out.swap_in == [(0, 4), (1, 3)]
    assert plan(out) == [("b", 4)]
    assert b.block_table == [4, 3, 1]
    assert b.num_computed_tokens == 12 and len(b.output_token_ids) == 1


def test_swap_preempts_the_last_running_sequence():
    sched = make_scheduler(num_blocks=4, num_host_blocks=4, max_step_tokens=100, preempt_mode=0)
    a, b, c = make_seq("a", 4), make_seq("b", 4), make_seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert out.preempted == [c] and out.swap_out == [(2, 0)]
    assert (a.block_table, b.block_table) == ([0, 3], [1, 2])
    assert c.host_block_table == [0] and c.num_computed_tokens == 4
    assert ids(sched.swapped) == ["c"] and ids(sched.running) == ["a", "b"]


# ---- victim choice -------------------------------------------------------------------------
def test_priority_preempts_lowest_priority_first():
    sched = make_scheduler(num_blocks=3, max_step_tokens=100, preempt_mode=1, policy="priority")
    a = make_seq("a", 4, priority=0)
    b = make_seq("b", 4, priority=2)
    c = make_seq("c", 4, priority=1)
    for s in (a, b, c):
        sched.add(s)
    assert ids(sched.waiting) == ["a", "c", "b"]
    assert plan(step(sched)) == [("a", 4), ("c", 4), ("b", 4)]
    assert (a.block_table, c.block_table, b.block_table) == ([0], [1], [2])

    # a needs a second block: b (priority 2) goes; then c needs one and is itself the last.
    out = step(sched)
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b, c]
    assert a.block_table == [0, 2]
    assert ids(sched.waiting) == ["c", "b"]
    assert ids(sched.running) == ["a"]
    assert (b.num_computed_tokens, c.num_computed_tokens) == (0, 0)


def test_an_urgent_waiting_request_preempts_less_urgent_running_ones_for_a_slot():
    """Priority policy (vLLM's priority preemption): both slots held by priority-5 sequences, a
    priority-0 arrival preempts the least urgent one (the later arrival) and starts in the same
    step; a waiting request of equal priority preempts nobody."""
    sched = make_scheduler(num_blocks=32, max_step_tokens=100, max_num_seqs=2, policy="priority")
    a, b = make_seq("a", 4, priority=5), make_seq("b", 4, priority=5)
    for s in (a, b):
        sched.add(s)
    step(sched)
    peer = make_seq("peer", 4, priority=5)
    sched.add(peer)
    out = step(sched)
    assert out.preempted == [] and plan(out) == [("a", 1), ("b", 1)]

    urgent = make_seq("urgent", 4, priority=0)
    sched.add(urgent)
    out = step(sched)
    assert out.preempted == [b]
    assert plan(out) == [("a", 1), ("urgent", 4)]
    assert ids(sched.running) == ["urgent", "a"]
    assert sched.num_preemptions == 1


def test_an_urgent_waiting_request_preempts_for_blocks_and_goes_before_swapped_ones():
    """Swap mode, a full pool: the urgent request swaps the least urgent running sequence out
    for the blocks its prompt needs, and is admitted before that sequence swaps back in."""
    sched = make_scheduler(num_blocks=4, max_step_tokens=100, policy="priority",
                           num_host_blocks=8)
    a, b = make_seq("a", 5, priority=1), make_seq("b", 5, priority=3)
    for s in (a, b):
        sched.add(s)
    step(sched)  # 2 blocks each: the pool is full
    urgent = make_seq("urgent", 6, priority=0)
    sched.add(urgent)
    out = step(sched)
    assert out.preempted == [b] and len(out.swap_out) == 2 and ids(sched.swapped) == ["b"]
    assert plan(out) == [("a", 1), ("urgent", 6)]
    # b waits in the host pool until the more urgent sequences leave room.
    out = step(sched)
    assert out.swap_in == [] and ids(sched.swapped) == ["b"]
    sched.finish(urgent)
    out = step(sched)
    assert len(out.swap_in) == 2 and ids(sched.running) == ["a", "b"]


def test_fifo_preempts_latest_arrival_first():
    sched = make_scheduler(num_blocks=3, max_step_tokens=100, preempt_mode=1)
    a = make_seq("a", 4, priority=5)
    b = make_seq("b", 4, priority=0)
    c = make_seq("c", 4, priority=9)
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched)) == [("a", 4), ("b", 4), ("c", 4)]
    out = step(sched)
    assert plan(out) == [("a", 1)]
    assert out.preempted == [c, b]
    assert ids(sched.waiting) == ["b", "c"]


# ---- forked sequences (parallel sampling, beam search) -------------------------------------
def test_fork_of_running_parent_shares_blocks_and_copies_on_write():
    sched = make_scheduler(num_blocks=8, max_step_tokens=100, enable_prefix_caching=False)
    bm = sched.block_manager
    parent = make_seq("p", 10)
    sched.add(parent)
    step(sched)  # prompt computed (blocks 0, 1, 2), one token sampled
    child = parent.fork(1)
    child.output_token_ids[-1] = sampled_token()  # the child sampled another token
    sched.fork(parent, child)
    assert child.status == SequenceStatus.RUNNING and sched.running == [parent, child]
    assert child.block_table == [0, 1, 2] and child.num_computed_tokens == 10
    assert (child.arrival_time, child.admission_order) == (parent.arrival_time,
                                                            parent.admission_order)
    out = step(sched)
    # Both write position 10, in shared block 2: the first to allocate copies it.
    assert plan(out) == [("p", 1), ("p", 1)]
    assert out.copy_blocks == [(2, 3)]
    assert parent.block_table == [0, 1, 3] and child.block_table == [0, 1, 2]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert step(sched).copy_blocks == []
    sched.finish(parent)
    sched.finish(child)
    assert bm.num_free_blocks == 8


def test_fork_of_a_parent_without_blocks_recomputes():
    sched = make_scheduler(num_blocks=8, max_step_tokens=100)
    parent = make_seq("p", 6)
    sched.add(parent)  # waiting: no blocks yet
    parent.output_token_ids.append(sampled_token())
    child = parent.fork(1)
    sched.fork(parent, child)
    assert child.status == SequenceStatus.WAITING and sched.waiting == [parent, child]
    assert child.block_table == [] and child.num_computed_tokens == 0
    assert plan(step(sched)) == [("p", 7), ("p", 7)]


def test_idle_running_sequence_is_not_scheduled():
    sched = make_scheduler(num_blocks=8, max_step_tokens=100)
    a, b = make_seq("a", 5), make_seq("b", 6)
    sched.add(a)
    sched.add(b)
    step(sched)
    a.output_token_ids.pop()  # a is idle: all its tokens are computed, nothing sampled yet
    assert plan(step(sched)) == [("b", 1)]
    assert sched.running == [a, b]


def test_idle_sequences_holding_the_pool_are_preempted_for_recompute():
    sched = make_scheduler(num_blocks=4, max_step_tokens=100, num_host_blocks=8)  # swap mode
    bm = sched.block_manager
    a = make_seq("a", 14)
    sched.add(a)
    step(sched)
    a.output_token_ids.pop()  # idle, holding all 4 blocks
    b = make_seq("b", 5, arrival_time=0.0)  # e.g. a's sibling, queued ahead of it
    sched.add(b)
    out = sched.schedule()
    # Nothing could run: the idle sequence is freed (recompute, not swapped: swapping it back in
    # would take the same blocks again) and b gets its blocks next step.
    assert out.is_empty and out.preempted == [a] and out.swap_out == []
    assert a.status == SequenceStatus.WAITING and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 4 and sched.waiting == [b, a]
    assert plan(step(sched)) == [("b", 5)]


def test_admission_reserves_the_width_of_a_multi_sequence_request():
    sched = make_scheduler(num_blocks=32, max_step_tokens=100, max_num_seqs=4)
    a, b = make_seq("a", 4), make_seq("b", 4)
    b.num_reserved_slots = 4  # will fork into 4 sequences
    sched.add(a)
    sched.add(b)
    assert plan(step(sched)) == [("a", 4)]  # 1 running + 4 reserved > 4
    sched.finish(a)
    assert plan(step(sched)) == [("b", 4)]


def test_a_sequence_short_of_blocks_preempts_an_idle_one_before_itself():
    """A beam's sibling catching up (chunked prefill after a preemption) while an idle beam
    holds most of the pool: giving up its own blocks each time, it was readmitted and ran short
    again forever (the idle beam never let go); the idle one goes instead."""
    sched = make_scheduler(num_blocks=5, max_step_tokens=4)
    bm = sched.block_manager
    a = make_seq("a", 12)
    sched.add(a)
    for _ in range(3):
        step(sched)
    a.output_token_ids.pop()  # idle: all 12 computed (3 blocks), waiting for its sibling
    b = make_seq("b", 12)
    sched.add(b)
    assert plan(step(sched)) == [("b", 4)] and plan(step(sched)) == [("b", 4)]  # 4th, 5th block
    assert bm.num_free_blocks == 0
    out = step(sched)  # b's last chunk needs a 6th block: a's go
    assert plan(out) == [("b", 4)] and out.preempted == [a]
    assert a.status == SequenceStatus.WAITING and a.num_computed_tokens == 0
    assert sched.running == [b] and sched.waiting == [a]
