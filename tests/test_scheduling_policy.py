"""User scheduling policies (`ksana_llm.SchedulingPolicy`, DESIGN §4 `Engine(scheduler=...)`):
the scheduler's queue order and preemption under a policy of one's own, how a policy is named
(object, class, import path), what a broken policy does, and the same on a real engine."""

from __future__ import annotations

import threading

import pytest

import ksana_llm as kt
from ksana_llm.engine.scheduling_policy import (FifoPolicy, PriorityPolicy,
                                                resolve_scheduling_policy)
from tests.scheduler_harness import ids, make_scheduler, make_seq, plan, step
from tests.scheduling_policies import (BrokenRankPolicy, PreemptiveShortestPromptFirst,
                                       RecordingPolicy, ShortestPromptFirst)


# ---- the scheduler under a policy ----------------------------------------------------------------
def test_a_policy_orders_the_waiting_queue_and_admission():
    sched = make_scheduler(max_step_tokens=100, max_num_seqs=1, policy=ShortestPromptFirst())
    for name, length in [("long", 12), ("short", 3), ("mid", 6), ("short-later", 3)]:
        sched.add(make_seq(name, length))
    # Equal ranks keep their arrival order.
    assert ids(sched.waiting) == ["short", "short-later", "mid", "long"]
    assert plan(step(sched)) == [("short", 3)]


def test_a_policy_that_is_not_preemptive_lets_the_running_sequence_finish():
    sched = make_scheduler(max_step_tokens=100, max_num_seqs=1, policy=ShortestPromptFirst())
    sched.add(make_seq("long", 12))
    step(sched)
    sched.add(make_seq("tiny", 1))
    out = sched.schedule()
    assert not out.preempted and plan(out) == [("long", 1)] and ids(sched.waiting) == ["tiny"]


def test_a_preemptive_policy_pushes_out_a_running_sequence_of_a_larger_rank():
    sched = make_scheduler(max_step_tokens=100, max_num_seqs=1, preempt_mode=1,
                           policy=PreemptiveShortestPromptFirst())
    sched.add(make_seq("long", 12))
    step(sched)
    sched.add(make_seq("tiny", 1))
    out = sched.schedule()
    assert ids(out.preempted) == ["long"] and plan(out) == [("tiny", 1)]
    assert ids(sched.waiting) == ["long"]


def test_a_preemptive_policy_never_pushes_out_an_equal_rank():
    sched = make_scheduler(max_step_tokens=100, max_num_seqs=1, preempt_mode=1,
                           policy=PreemptiveShortestPromptFirst())
    sched.add(make_seq("first", 4))
    step(sched)
    sched.add(make_seq("same-length", 4))
    out = sched.schedule()
    assert not out.preempted and plan(out) == [("first", 1)]


def test_the_policy_sees_the_request_once_and_forks_keep_its_rank():
    policy = RecordingPolicy()
    sched = make_scheduler(max_step_tokens=100, policy=policy)
    seq = make_seq("r", 5, priority=7)
    seq.config = kt.GenerationConfig(max_new_tokens=9, num_return_sequences=3, do_sample=True)
    seq.num_reserved_slots = 3
    sched.add(seq)
    [info] = policy.seen
    assert (info.request_id, info.priority, info.arrival_time, info.num_prompt_tokens,
            info.max_new_tokens, info.num_sequences) == ("r", 7, seq.arrival_time, 5, 9, 3)
    with pytest.raises(AttributeError):
        info.priority = 0  # read-only: the scheduler's state is not the policy's to change
    step(sched)
    child = seq.fork(1)
    sched.fork(seq, child)
    assert child.rank == seq.rank and len(policy.seen) == 1


@pytest.mark.parametrize("request_id", ["nan", "inf", "text", "bool", "huge"])
def test_a_rank_that_is_not_a_finite_number_refuses_only_that_request(request_id):
    sched = make_scheduler(max_step_tokens=100, policy=BrokenRankPolicy())
    sched.add(make_seq("fine", 2))
    with pytest.raises(ValueError, match="rank\\(\\) must return a finite number"):
        sched.add(make_seq(request_id, 2))
    sched.add(make_seq("fine-too", 2))
    assert ids(sched.waiting) == ["fine", "fine-too"]
    assert [s.admission_order for s in sched.waiting] == [0, 1]


def test_numpy_ranks_are_numbers():
    import numpy as np

    class NumpyRank(kt.SchedulingPolicy):
        def rank(self, request):
            return np.int64(request.num_prompt_tokens)

    sched = make_scheduler(max_step_tokens=100, policy=NumpyRank())
    sched.add(make_seq("long", 6))
    sched.add(make_seq("short", 2))
    assert ids(sched.waiting) == ["short", "long"] and sched.waiting[0].rank == 2.0


# ---- naming a policy -----------------------------------------------------------------------------
def test_policies_by_name_class_instance_and_import_path():
    assert isinstance(resolve_scheduling_policy("fifo"), FifoPolicy)
    assert isinstance(resolve_scheduling_policy("fcfs"), FifoPolicy)
    assert isinstance(resolve_scheduling_policy("priority"), PriorityPolicy)
    policy = ShortestPromptFirst()
    assert resolve_scheduling_policy(policy) is policy
    assert type(resolve_scheduling_policy(ShortestPromptFirst)) is ShortestPromptFirst
    for path in ("tests.scheduling_policies:ShortestPromptFirst",
                 "tests.scheduling_policies.ShortestPromptFirst"):
        assert type(resolve_scheduling_policy(path)) is ShortestPromptFirst
    assert kt.EngineConfig(scheduler_policy="fcfs").scheduler_policy == "fifo"
    assert kt.EngineConfig(scheduler_policy=ShortestPromptFirst).scheduler_policy.rank(
        kt.RequestInfo("r", 0, 0.0, 4, 1, 1)) == 4


@pytest.mark.parametrize("spec, message", [
    ("lifo", "neither 'fifo', 'priority' nor a 'module:Class'"),
    ("no_such_module:Policy", "cannot import 'no_such_module'"),
    ("tests.scheduling_policies:NoSuchPolicy", "has no 'NoSuchPolicy'"),
    ("ksana_llm:EngineConfig", "EngineConfig is not a SchedulingPolicy subclass"),
    (42, "got int"),
])
def test_a_bad_policy_is_refused_with_the_config(spec, message):
    with pytest.raises(ValueError, match="scheduler_policy") as err:
        kt.EngineConfig(scheduler_policy=spec)
    assert message in str(err.value)


def test_a_policy_named_by_path_is_made_once_per_engine(model):
    """Checking a config imports the class but makes no policy: the engine's scheduler makes
    the one it uses."""
    from tests.scheduling_policies import CountedPolicy

    before = CountedPolicy.made
    config = kt.EngineConfig(scheduler_policy="tests.scheduling_policies:CountedPolicy")
    assert CountedPolicy.made == before
    with kt.Engine(model, config=config, num_device_blocks=16) as engine:
        assert isinstance(engine.scheduling_policy, CountedPolicy)
    assert CountedPolicy.made == before + 1


def test_a_policy_class_that_needs_arguments_is_refused():
    class Weighted(kt.SchedulingPolicy):
        def __init__(self, weight: float) -> None:
            self.weight = weight

    with pytest.raises(ValueError, match="pass an instance instead"):
        kt.EngineConfig(scheduler_policy=Weighted)
    assert kt.EngineConfig(scheduler_policy=Weighted(2.0)).scheduler_policy.weight == 2.0


# ---- on a real engine ----------------------------------------------------------------------------
PROMPTS = {  # submitted longest first
    "long": "Write a long story about a dragon who lives under a mountain and counts gold:",
    "mid": "Name three colours of the rainbow:",
    "short": "Hi",
}


def test_an_engine_runs_queued_requests_in_its_policy_order(model):
    cfg = kt.GenerationConfig(max_new_tokens=4)
    with kt.Engine(model, generation_config=cfg) as fifo:
        expected = {name: fifo.generate_outputs([p])[0].token_ids for name, p in PROMPTS.items()}
    finished: list[str] = []
    # One sequence at a time: whoever the scheduler admits next finishes next.
    with kt.Engine(model, num_device_blocks=64, max_num_seqs=1, generation_config=cfg,
                   scheduler=ShortestPromptFirst()) as engine:
        assert isinstance(engine.scheduling_policy, ShortestPromptFirst)
        gate = threading.Event()
        blocker = engine.submit(kt.Request("Count to ten:", callback=lambda out: gate.wait(5)))
        handles = {name: engine.submit(kt.Request(
            prompt, callback=lambda out, name=name: out.finished and finished.append(name)))
            for name, prompt in PROMPTS.items()}
        gate.set()
        blocker.result(timeout=60)
        outputs = {name: h.result(timeout=60) for name, h in handles.items()}
    assert finished == ["short", "mid", "long"]
    assert {name: out.token_ids for name, out in outputs.items()} == expected


def test_an_engine_with_a_broken_policy_refuses_that_request_and_serves_the_rest(model):
    with kt.Engine(model, num_device_blocks=64, scheduler=BrokenRankPolicy(),
                   generation_config=kt.GenerationConfig(max_new_tokens=2)) as engine:
        # The policy runs on the engine's thread: the request fails with the policy's error.
        with pytest.raises(kt.RequestError, match="finite number") as err:
            engine.submit(kt.Request("Hi", request_id="nan")).result(timeout=60)
        assert isinstance(err.value.__cause__, ValueError)
        with pytest.raises(kt.RequestError, match="no rank") as err:
            engine.submit(kt.Request("Hi", request_id="raises")).result(timeout=60)
        assert isinstance(err.value.__cause__, KeyError)
        assert len(engine.submit(kt.Request("Hi", request_id="ok")).result(timeout=60).token_ids) == 2
        assert engine.is_running


def test_priority_reaches_a_policy_that_uses_it_and_is_refused_by_one_that_does_not(model):
    policy = RecordingPolicy()
    with kt.Engine(model, num_device_blocks=64, scheduler=policy,
                   generation_config=kt.GenerationConfig(max_new_tokens=1)) as engine:
        engine.submit(kt.Request("Hi", priority=4)).result(timeout=60)
    assert [info.priority for info in policy.seen] == [4]
    with kt.Engine(model, num_device_blocks=64, scheduler="tests.scheduling_policies:ShortestPromptFirst",
                   generation_config=kt.GenerationConfig(max_new_tokens=1)) as engine:
        with pytest.raises(ValueError, match="priority 4 needs an engine with scheduler='priority'"):
            engine.submit(kt.Request("Hi", priority=4))
