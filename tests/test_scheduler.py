"""Scheduler: token budget, chunked prefill, admission, preemption (swap / recompute), policies.

No model: `step()` below does what the engine core does after the runner returns — advance
`num_computed_tokens` by each scheduled chunk, publish full blocks in the prefix cache, and "sample"
one token for every sequence whose computed tokens caught up with its tokens. Expected values are
derived from the algorithm in `ksana_llm/engine/scheduler.py`: running sequences first (in policy
order), then swapped ones, then waiting ones; a preemption victim is the last running sequence
not yet scheduled this step (or the one being scheduled).
"""

from __future__ import annotations

import itertools

import pytest

from ksana_llm.engine.kv_cache import BlockManager
from ksana_llm.engine.request import Sequence, SequenceStatus
from ksana_llm.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig, SchedulerOutput
from ksana_llm.generation_config import GenerationConfig

_arrivals = itertools.count(1)
_prompt_bases = itertools.count(1)
_sampled = itertools.count(10_000_000)  # sampled token ids never collide with prompt tokens


def make_seq(request_id: str, tokens, *, priority: int = 0, arrival_time: float | None = None):
    if isinstance(tokens, int):  # n tokens no other request shares (no accidental prefix hits)
        base = 1000 * next(_prompt_bases)
        tokens = range(base, base + tokens)
    return Sequence(request_id, list(tokens), GenerationConfig(), priority=priority,
                    arrival_time=float(next(_arrivals)) if arrival_time is None else arrival_time)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, *, num_host_blocks: int = 0,
                   enable_prefix_caching: bool = True, **config) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                      num_host_blocks=num_host_blocks)
    return Scheduler(SchedulerConfig(**config), bm)


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step without a model."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.config.max_step_tokens
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.cache_full_blocks(item.seq)
    for item in out.scheduled:
        seq = item.seq
        assert seq.num_computed_tokens <= seq.num_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(next(_sampled))
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled]


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


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


# ---- forked sequences (parallel sampling, beam search) -------------------------------------
def test_fork_of_running_parent_shares_blocks_and_copies_on_write():
    sched = make_scheduler(num_blocks=8, max_step_tokens=100, enable_prefix_caching=False)
    bm = sched.block_manager
    parent = make_seq("p", 10)
    sched.add(parent)
    step(sched)  # prompt computed (blocks 0, 1, 2), one token sampled
    child = parent.fork(1)
    child.output_token_ids[-1] = next(_sampled)  # the child sampled another token
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
    parent.output_token_ids.append(next(_sampled))
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


# ---- LoRA slots -------------------------------------------------------------------------------
def lora_seq(request_id: str, lora_id: int, tokens: int = 4) -> Sequence:
    seq = make_seq(request_id, tokens)
    seq.lora_id = lora_id
    return seq


def test_more_adapters_than_slots_wait_while_the_others_run():
    """Two slots, three adapters: the third adapter's request waits (the base request and a
    request of a resident adapter behind it go ahead), then takes the slot the first adapter
    to go idle frees; a slot is reloaded only when its adapter changes, least recently used
    first."""
    sched = make_scheduler(max_step_tokens=100, max_loras=2)
    a, b, c, d, e = (lora_seq("a", 1), lora_seq("b", 2), lora_seq("c", 3), lora_seq("d", 0),
                     lora_seq("e", 1))
    for seq in (a, b, c, d, e):
        sched.add(seq)
    out = step(sched)
    assert plan(out) == [("a", 4), ("b", 4), ("d", 4), ("e", 4)]
    assert out.lora_loads == [(1, 1), (2, 2)]
    assert [s.lora_slot for s in (a, b, d, e)] == [1, 2, 0, 1]
    assert ids(sched.waiting) == ["c"]

    out = step(sched)  # every slot still held
    assert plan(out) == [("a", 1), ("b", 1), ("d", 1), ("e", 1)] and out.lora_loads == []
    sched.finish(b)
    out = step(sched)
    assert plan(out) == [("a", 1), ("d", 1), ("e", 1), ("c", 4)]
    assert out.lora_loads == [(2, 3)] and c.lora_slot == 2

    for seq in (a, e, c):
        sched.finish(seq)
    f, g = lora_seq("f", 4), lora_seq("g", 3)
    sched.add(f)
    sched.add(g)
    out = step(sched)
    # Adapter 1 (slot 1) went idle before adapter 3 (slot 2): f's adapter replaces it; g's
    # adapter is still resident.
    assert plan(out) == [("d", 1), ("f", 4), ("g", 4)]
    assert out.lora_loads == [(1, 4)] and (f.lora_slot, g.lora_slot) == (1, 2)
    assert sched.num_lora_loads == 4


def test_lora_residency_keeps_held_adapters():
    from ksana_llm.engine.lora_residency import LoraResidency

    slots = LoraResidency(2)
    assert (slots.place(10, set()), slots.place(11, set())) == (1, 2)
    assert slots.place(12, {10, 11}) is None  # both held: nothing moves
    assert slots.place(12, {11}) == 1 and slots.resident == {1: 12, 2: 11}
    assert slots.place(13, {12}) == 2
    # Both slots were refilled before a step ran: only each slot's last load is copied.
    assert slots.take_loads() == [(1, 12), (2, 13)] and slots.take_loads() == []
    assert slots.forget(12) == 1 and slots.resident == {2: 13}
    assert slots.place(14, {13}) == 1 and slots.slot_of(14) == 1


@pytest.mark.parametrize("max_wait", [0, 2, None])
def test_a_request_waiting_too_long_for_a_slot_drains_the_adapters_holding_them(max_wait):
    """One slot held by adapter 1, whose newer requests keep coming: the adapter-2 request
    lets them go ahead for `lora_max_wait_steps` steps, then adapter 1 takes no newer requests
    (base requests still go) until its slot frees for adapter 2. None: never (vLLM)."""
    sched = make_scheduler(max_step_tokens=100, max_loras=1, lora_max_wait_steps=max_wait)
    a, b = lora_seq("a", 1), lora_seq("b", 2)
    sched.add(a)
    sched.add(b)
    newer = []
    admitted_newer = []
    for k in range(4):  # a newer adapter-1 request and a base request arrive each step
        newer.extend([lora_seq(f"n{k}", 1), lora_seq(f"base{k}", 0)])
        sched.add(newer[-2])
        sched.add(newer[-1])
        out = step(sched)
        admitted = {item.seq.request_id for item in out.scheduled if item.num_new_tokens == 4}
        assert f"base{k}" in admitted and "b" not in admitted
        admitted_newer.append(f"n{k}" in admitted)
    # b's k-th wait (k = 1, 2, ...) drains adapter 1 once k > max_wait.
    assert admitted_newer == {0: [False] * 4, 2: [True, True, False, False],
                              None: [True] * 4}[max_wait]
    assert b.num_lora_waits == 4
    for seq in list(sched.running):
        sched.finish(seq)
    out = step(sched)
    admitted = [item.seq.request_id for item in out.scheduled]
    if max_wait is None:
        assert admitted == ["b"]  # nothing newer was held back
    else:
        # b takes the slot; adapter 1's held-back requests wait for it in turn.
        assert admitted == ["b"] and out.lora_loads == [(1, 2)]
        assert ids(sched.waiting) == [f"n{k}" for k in range(4) if not admitted_newer[k]]


def test_draining_holds_back_only_the_adapter_that_frees_first():
    """Two slots held by adapter 1 (two requests) and adapter 2 (one): a waiting adapter-3
    request that waited too long drains adapter 2 alone; newer adapter-1 requests still go."""
    sched = make_scheduler(max_step_tokens=100, max_loras=2, lora_max_wait_steps=0)
    a1, a2, b = lora_seq("a1", 1), lora_seq("a2", 1), lora_seq("b", 2)
    for seq in (a1, a2, b):
        sched.add(seq)
    step(sched)
    c = lora_seq("c", 3)
    sched.add(c)
    newer = [lora_seq("a3", 1), lora_seq("b2", 2)]
    for seq in newer:
        sched.add(seq)
    out = step(sched)
    assert [item.seq.request_id for item in out.scheduled if item.num_new_tokens == 4] == ["a3"]
    assert ids(sched.waiting) == ["c", "b2"] and c.lora_drain_target == 2
    sched.finish(b)
    out = step(sched)
    # Adapter 2's slot is free: c takes it; b2 (adapter 2, now out of a slot) waits.
    assert out.lora_loads == [(2, 3)] and c.lora_slot == 2 and ids(sched.waiting) == ["b2"]
    assert (c.num_lora_waits, c.lora_drain_target) == (0, 0)


def test_an_adapter_moves_only_for_a_request_that_gets_its_blocks():
    """The pool is full: the adapter-2 request cannot start, so adapter 1 stays in the slot
    (no copy is made for a request that waits anyway)."""
    sched = make_scheduler(num_blocks=2, max_step_tokens=100, max_loras=1)
    a = lora_seq("a", 1)
    sched.add(a)
    step(sched)
    sched.finish(a)
    hog = make_seq("hog", 7)  # both blocks, with room for its next token
    sched.add(hog)
    step(sched)
    sched.add(lora_seq("b", 2))
    out = step(sched)
    assert plan(out) == [("hog", 1)]
    assert out.lora_loads == [] and sched.lora.resident == {1: 1}
    assert ids(sched.waiting) == ["b"]
