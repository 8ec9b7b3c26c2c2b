"""Scheduler and LoRA slots: requests for more adapters than slots take turns, held adapters
stay, a request waiting too long drains the adapters holding the slots.

Expected values are derived from the algorithm in `ksana_llm/engine/scheduler.py`: running
sequences first (in policy order), then swapped ones, then waiting ones; a preemption victim is
the last running sequence not yet scheduled this step (or the one being scheduled). Steps run
without a model: `tests/scheduler_harness.py`'s `step()`.
"""

from __future__ import annotations

import pytest

from ksana_llm.engine.request import Sequence
from tests.scheduler_harness import ids, make_scheduler, make_seq, plan, step


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
