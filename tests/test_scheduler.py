"""Scheduler: token budget, chunked prefill, admission, prefix caching, queue policies,
removal. (Preemption: test_scheduler_preemption.py; LoRA slots: test_scheduler_lora.py.)

Expected values are derived from the algorithm in `ksana_llm/engine/scheduler.py`: running
sequences first (in policy order), then swapped ones, then waiting ones; a preemption victim is
the last running sequence not yet scheduled this step (or the one being scheduled). Steps run
without a model: `tests/scheduler_harness.py`'s `step()`.
"""

from __future__ import annotations

import pytest

from ksana_llm.engine.request import SequenceStatus
from ksana_llm.engine.scheduler_records import QueueFullError
from tests.scheduler_harness import ids, make_scheduler, make_seq, plan, step


# ---- token budget and chunking -------------------------------------------------------------
def test_budget_splits_two_prompts():
    sched = make_scheduler(max_step_tokens=10)
    a, b = make_seq("a", 8), make_seq("b", 8)
    sched.add(a)
    sched.add(b)

    out = step(sched)
    assert plan(out) == [("a", 8), ("b", 2)]
    assert out.num_batched_tokens == 10
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    assert ids(sched.running) == ["a", "b"] and sched.waiting == []
    assert a.status == b.status == SequenceStatus.RUNNING
    assert (len(a.output_token_ids), len(b.output_token_ids)) == (1, 0)

    # a decodes (1), b's prefill continues with the rest of the budget (6 of 9 remaining).
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 6)]
    assert (a.block_table, b.block_table) == ([0, 1, 3], [2, 4])
    assert (len(a.output_token_ids), len(b.output_token_ids)) == (2, 1)

    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert (a.block_table, b.block_table) == ([0, 1, 3], [2, 4, 5])
    assert (a.num_computed_tokens, b.num_computed_tokens) == (10, 9)


def test_split_fuse_token_num_caps_prefill_chunks():
    sched = make_scheduler(max_step_tokens=100, split_fuse_token_num=3)
    a, b = make_seq("a", 8), make_seq("b", 5)
    sched.add(a)
    sched.add(b)
    plans = [plan(step(sched)) for _ in range(4)]
    assert plans == [
        [("a", 3), ("b", 3)],
        [("a", 3), ("b", 2)],  # b's prompt done -> sampled
        [("a", 2), ("b", 1)],  # a's prompt done -> sampled
        [("a", 1), ("b", 1)],
    ]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (9, 7)
    assert (len(a.output_token_ids), len(b.output_token_ids)) == (2, 3)


def test_split_fuse_and_budget_together():
    sched = make_scheduler(max_step_tokens=5, split_fuse_token_num=4)
    a, b = make_seq("a", 6), make_seq("b", 6)
    sched.add(a)
    sched.add(b)
    plans = [plan(step(sched)) for _ in range(4)]
    assert plans == [
        [("a", 4), ("b", 1)],
        [("a", 2), ("b", 3)],
        [("a", 1), ("b", 2)],
        [("a", 1), ("b", 1)],
    ]


def test_decodes_are_served_before_new_prefills():
    sched = make_scheduler(max_step_tokens=10)
    a = make_seq("a", 4)
    sched.add(a)
    assert plan(step(sched)) == [("a", 4)]

    b = make_seq("b", 12)
    sched.add(b)
    assert plan(step(sched)) == [("a", 1), ("b", 9)]
    assert plan(step(sched)) == [("a", 1), ("b", 3)]
    assert plan(step(sched)) == [("a", 1), ("b", 1)]


def test_running_sequences_beyond_the_budget_wait_their_turn():
    sched = make_scheduler(max_step_tokens=2)
    seqs = [make_seq(name, 1) for name in "abc"]
    for s in seqs:
        sched.add(s)
    assert plan(step(sched)) == [("a", 1), ("b", 1)]
    assert ids(sched.running) == ["a", "b"] and ids(sched.waiting) == ["c"]
    assert plan(step(sched)) == [("a", 1), ("b", 1)]
    sched.finish(seqs[0])
    assert plan(step(sched)) == [("b", 1), ("c", 1)]


def test_max_num_seqs_bounds_admission():
    sched = make_scheduler(max_step_tokens=100, max_num_seqs=2)
    a, b, c = make_seq("a", 4), make_seq("b", 4), make_seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched)) == [("a", 4), ("b", 4)]
    assert ids(sched.waiting) == ["c"]
    assert plan(step(sched)) == [("a", 1), ("b", 1)]
    sched.finish(a)
    assert a.status == SequenceStatus.FINISHED
    assert plan(step(sched)) == [("b", 1), ("c", 4)]
    assert ids(sched.running) == ["b", "c"]


def test_waiting_head_of_line_blocks_later_requests():
    # 4 blocks of 4 tokens: a takes 3, b (2 blocks) does not fit, c (1 block) would but is behind.
    sched = make_scheduler(num_blocks=4, max_step_tokens=100)
    a, b, c = make_seq("a", 12), make_seq("b", 8), make_seq("c", 2)
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched)) == [("a", 12)]
    assert ids(sched.waiting) == ["b", "c"]
    assert plan(step(sched)) == [("a", 1)]
    assert a.block_table == [0, 1, 2, 3]
    sched.finish(a)
    assert plan(step(sched)) == [("b", 8), ("c", 2)]


def test_empty_step():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.num_batched_tokens == 0
    assert not sched.has_work() and sched.num_unfinished == 0


# ---- prefix caching through the scheduler --------------------------------------------------
def test_shared_prefix_computes_only_new_tokens():
    sched = make_scheduler(num_blocks=16, max_step_tokens=100)
    bm = sched.block_manager
    a = make_seq("a", range(1, 11))
    sched.add(a)
    assert plan(step(sched)) == [("a", 10)]
    assert a.block_table == [0, 1, 2]
    assert a.num_cached_tokens == 0

    # Shares a's two full blocks (8 tokens) and adds 3: only those 3 are computed.
    b = make_seq("b", list(range(1, 9)) + [20, 21, 22])
    sched.add(b)
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 11 - 8)]
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert b.num_computed_tokens == 11
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert (bm.prefix_queries, bm.prefix_hits) == (10 + 11, 8)

    # Identical prompt: the last full block is recomputed so logits exist -> 10 - 8 = 2.
    c = make_seq("c", range(1, 11))
    sched.add(c)
    assert plan(step(sched)) == [("a", 1), ("b", 1), ("c", 2)]
    assert c.block_table == [0, 1, 4]
    assert c.num_cached_tokens == 8

    # An 8-token prompt equal to a's first two blocks reuses only one: 8 - 4 = 4 computed.
    d = make_seq("d", range(1, 9))
    sched.add(d)
    assert plan(step(sched)) == [("a", 1), ("b", 1), ("c", 1), ("d", 4)]
    # a and b cross into a fourth block first (their 13th token), so d's new block is 7.
    assert (a.block_table, b.block_table) == ([0, 1, 2, 5], [0, 1, 3, 6])
    assert d.block_table == [0, 7]
    assert d.num_cached_tokens == 4


def test_shared_prefix_survives_the_first_request():
    sched = make_scheduler(num_blocks=8, max_step_tokens=100)
    bm = sched.block_manager
    a = make_seq("a", range(1, 11))
    sched.add(a)
    step(sched)
    sched.finish(a)
    assert a.status == SequenceStatus.FINISHED
    # a's partial block 2 first, its cached blocks (tail first) at the back.
    assert list(bm.free_queue) == [2, 3, 4, 5, 6, 7, 1, 0]

    b = make_seq("b", list(range(1, 9)) + [30])
    sched.add(b)
    assert plan(step(sched)) == [("b", 1)]
    assert b.block_table == [0, 1, 2]
    assert list(bm.free_queue) == [3, 4, 5, 6, 7]


def test_prefix_not_reused_when_caching_disabled():
    sched = make_scheduler(max_step_tokens=100, enable_prefix_caching=False)
    a = make_seq("a", range(1, 11))
    sched.add(a)
    step(sched)
    b = make_seq("b", range(1, 11))
    sched.add(b)
    assert plan(step(sched)) == [("a", 1), ("b", 10)]
    assert b.num_cached_tokens == 0


# ---- queue policies ------------------------------------------------------------------------
def test_queue_full_error():
    sched = make_scheduler(max_step_tokens=100, max_queue_size=2)
    sched.add(make_seq("a", 4))
    sched.add(make_seq("b", 4))
    with pytest.raises(QueueFullError):
        sched.add(make_seq("c", 4))
    assert ids(sched.waiting) == ["a", "b"]
    assert sched.num_unfinished == 2
    # Admission empties the waiting queue; running requests do not count against it.
    assert plan(step(sched)) == [("a", 4), ("b", 4)]
    sched.add(make_seq("c", 4))
    sched.add(make_seq("d", 4))
    with pytest.raises(QueueFullError):
        sched.add(make_seq("e", 4))
    assert sched.num_unfinished == 4


def test_priority_policy_orders_by_priority_then_arrival():
    sched = make_scheduler(max_step_tokens=100, policy="priority")
    specs = [("p2", 2), ("p0-first", 0), ("p1", 1), ("p0-second", 0), ("p-neg", -1)]
    for name, prio in specs:
        sched.add(make_seq(name, 2, priority=prio))
    assert ids(sched.waiting) == ["p-neg", "p0-first", "p0-second", "p1", "p2"]
    assert [n for n, _ in plan(step(sched))] == ["p-neg", "p0-first", "p0-second", "p1", "p2"]
    assert ids(sched.running) == ["p-neg", "p0-first", "p0-second", "p1", "p2"]


def test_fifo_policy_ignores_priority():
    sched = make_scheduler(max_step_tokens=100)
    for name, prio in [("x", 2), ("y", 0), ("z", 1)]:
        sched.add(make_seq(name, 2, priority=prio))
    assert ids(sched.waiting) == ["x", "y", "z"]


def test_equal_arrival_times_fall_back_to_admission_order():
    for policy in ("fifo", "priority"):
        sched = make_scheduler(policy=policy)
        for name in ("first", "second", "third"):
            sched.add(make_seq(name, 2, arrival_time=5.0))
        assert ids(sched.waiting) == ["first", "second", "third"]
        assert [s.admission_order for s in sched.waiting] == [0, 1, 2]


def test_priority_budget_goes_to_higher_priority_first():
    sched = make_scheduler(max_step_tokens=6, policy="priority")
    low = make_seq("low", 4, priority=1)
    high = make_seq("high", 4, priority=0)
    sched.add(low)
    sched.add(high)
    assert plan(step(sched)) == [("high", 4), ("low", 2)]


# ---- remove / finish -----------------------------------------------------------------------
def test_remove_waiting_sequence():
    sched = make_scheduler(max_step_tokens=100)
    a, b = make_seq("a", 4), make_seq("b", 4)
    sched.add(a)
    sched.add(b)
    sched.remove(a)
    assert ids(sched.waiting) == ["b"]
    assert plan(step(sched)) == [("b", 4)]
    assert b.block_table == [0]


def test_remove_running_sequence_frees_its_blocks():
    sched = make_scheduler(num_blocks=8, max_step_tokens=100)
    bm = sched.block_manager
    a, b = make_seq("a", 10), make_seq("b", 5)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    sched.remove(a)
    assert a.block_table == []
    assert ids(sched.running) == ["b"]
    assert bm.ref_counts == [0, 0, 0, 1, 1, 0, 0, 0]
    assert list(bm.free_queue) == [2, 5, 6, 7, 1, 0]
    sched.finish(b)
    assert b.status == SequenceStatus.FINISHED
    assert bm.ref_counts == [0] * 8
    assert list(bm.free_queue) == [4, 2, 5, 6, 7, 1, 0, 3]
    assert not sched.has_work()


def test_remove_swapped_sequence_frees_its_host_blocks():
    sched = make_scheduler(num_blocks=5, num_host_blocks=4, max_step_tokens=100, preempt_mode=0)
    bm = sched.block_manager
    a, b = make_seq("a", 8), make_seq("b", 8)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    assert ids(sched.swapped) == ["b"] and b.host_block_table == [0, 1]
    assert bm.free_host_blocks == [3, 2]
    sched.remove(b)
    assert sched.swapped == []
    assert b.host_block_table == []
    assert bm.free_host_blocks == [3, 2, 1, 0]
    assert sched.num_unfinished == 1
    sched.finish(a)
    assert bm.num_free_blocks == 5
    assert not sched.has_work()


@pytest.mark.parametrize("preempt_mode", [0, 1])
def test_requests_run_to_completion_and_release_everything(preempt_mode):
    # 5 blocks of 4 tokens for 5 requests of 3..11 prompt tokens + 4 outputs: preemptions happen.
    sched = make_scheduler(num_blocks=5, num_host_blocks=6, max_step_tokens=7,
                           preempt_mode=preempt_mode, split_fuse_token_num=5)
    bm = sched.block_manager
    seqs = [make_seq(f"r{i}", 3 + 2 * i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    for _ in range(200):
        if not sched.has_work():
            break
        step(sched)
        for s in list(sched.running):
            if len(s.output_token_ids) >= 4:
                sched.finish(s)
    assert not sched.has_work()
    assert sched.num_preemptions > 0
    assert all(s.status == SequenceStatus.FINISHED for s in seqs)
    assert all(len(s.output_token_ids) == 4 for s in seqs)
    assert all(s.block_table == [] and s.host_block_table == [] for s in seqs)
    assert bm.ref_counts == [0] * 5 and bm.num_free_blocks == 5
    assert sorted(bm.free_host_blocks) == list(range(6))
