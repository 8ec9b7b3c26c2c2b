"""The Python API's request lifecycle on the real default model: callbacks (in every call, and
whatever they raise), priorities, abort, the bounded queue, waiting timeouts and shutdown
(the rest of the API: test_engine_api.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

import ksana_llm as kt
from tests.engine_fixtures import engine_fixture, stats_once_blocks_free

PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


engine = engine_fixture(generation_config=kt.GenerationConfig(max_new_tokens=16),
                        num_device_blocks=256)


def test_submit_with_callback_and_priority(model):
    seen = []
    # One sequence per step, so the order of completion follows the priority order.
    with kt.Engine(model, num_device_blocks=64, max_num_seqs=1, scheduler="priority",
                   generation_config=kt.GenerationConfig(max_new_tokens=4)) as engine:
        gate = threading.Event()
        blocker = engine.submit(kt.Request(PROMPT, callback=lambda out: gate.wait(5)))
        handles = [engine.submit(kt.Request(f"Prompt number {p}", priority=p,
                                            callback=lambda out, p=p: out.finished and seen.append(p)))
                   for p in (5, 1, 3)]
        gate.set()
        for h in [blocker, *handles]:
            h.result(timeout=60)
    assert seen == [1, 3, 5]


def test_abort_frees_every_block(engine):
    handle = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=500,
                                                                  ignore_eos=True)))
    stream = iter(handle)
    next(stream)
    engine.abort(handle.id)
    out = handle.result(timeout=30)
    assert out.finish_reason == "abort" and out.finished
    stats = stats_once_blocks_free(engine)
    assert stats.num_free_kv_blocks == 256 and stats.num_running == 0


def test_full_queue_raises(model):
    with kt.Engine(model, num_device_blocks=64, max_queue_size=2, max_num_seqs=1,
                   generation_config=kt.GenerationConfig(max_new_tokens=64, ignore_eos=True)) as engine:
        handles, error = [], None
        for _ in range(10):
            try:
                handles.append(engine.submit(PROMPT))
            except kt.QueueFullError as exc:
                error = exc
                break
        assert error is not None and "queue is full" in str(error)
        assert len(handles) <= 3
        for h in handles:
            assert h.result(timeout=120).finished
        # After the queue drains, submissions work again.
        assert engine.generate("Hi", kt.GenerationConfig(max_new_tokens=2))


def test_generate_outputs_beyond_the_queue_bound(model):
    """More prompts than the queue holds: generate_outputs submits as the queue drains (it waits
    on an early request, whose result it reads again at the end) and returns every output."""
    config = kt.GenerationConfig(max_new_tokens=2, ignore_eos=True)
    result = []
    with kt.Engine(model, num_device_blocks=64, max_queue_size=1, max_num_seqs=1,
                   generation_config=config) as engine:
        worker = threading.Thread(
            target=lambda: result.append(engine.generate_outputs([PROMPT] * 5, use_tqdm=False)),
            daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "generate_outputs did not return"
        assert [len(o.token_ids) for o in result[0]] == [2] * 5
        # Two readers waiting at once both get the end; a later read answers at once.
        handle, answers = engine.submit(PROMPT), []
        readers = [threading.Thread(target=lambda: answers.append(handle.result(timeout=60)))
                   for _ in range(2)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=90)
        assert len(answers) == 2 and answers[0] is answers[1] is handle.result(timeout=1)


def test_the_engines_entry_points_are_the_real_ones():
    """Mixins declare what they use of Engine as stubs: RequestIntake must come before them
    among Engine's bases, or a stub would shadow the real method."""
    from ksana_llm.api.request_intake import RequestIntake

    for name in ("submit", "abort", "_enqueue", "_wait_for_queue_space"):
        assert getattr(kt.Engine, name) is getattr(RequestIntake, name), name


def test_shutdown_fails_pending_requests(model):
    engine = kt.Engine(model, num_device_blocks=64)
    handle = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=2000,
                                                                  ignore_eos=True)))
    next(iter(handle))  # running, holding KV blocks
    engine.shutdown()
    with pytest.raises(kt.api.outputs.RequestError):
        handle.result(timeout=30)
    with pytest.raises(kt.EngineDeadError):
        engine.submit(PROMPT)
    # What the engine held is released: stats show an idle engine, not the last step's counts.
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_kv_blocks) == (0, 0, 64)
    # And its KV cache's memory: a stopped engine still named (after a `with` block) must not
    # hold a pool the next engine would size its own from. The shared weights stay.
    runner = engine._core.runner
    assert sum(t.untyped_storage().nbytes()
               for pair in runner.kv_caches + runner.host_caches for t in pair) == 0
    assert all(p.untyped_storage().nbytes() for p in model.module.parameters())
    # The weights still serve: a new engine on the same model answers.
    with kt.Engine(model, num_device_blocks=64) as again:
        assert again.generate(PROMPT, kt.GenerationConfig(max_new_tokens=2)) != ""


def test_shutdown_from_a_callback_frees_the_kv_cache_as_the_loop_ends(model):
    """shutdown() on the engine thread (in a callback) cannot wait for that thread: the loop
    frees the KV cache itself as it ends."""
    engine = kt.Engine(model, num_device_blocks=64)
    handle = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=2000,
                                                                  ignore_eos=True),
                                      callback=lambda out: engine.shutdown()))
    with pytest.raises(kt.api.outputs.RequestError):
        handle.result(timeout=60)
    engine._thread.join(timeout=30)
    assert not engine._thread.is_alive()
    runner = engine._core.runner
    assert sum(t.untyped_storage().nbytes() for pair in runner.kv_caches for t in pair) == 0


@pytest.mark.parametrize("raised", [asyncio.CancelledError, KeyboardInterrupt, GeneratorExit,
                                    SystemExit])
def test_a_callback_raising_anything_fails_only_its_request(engine, raised):
    """Not only Exceptions: a stray CancelledError or KeyboardInterrupt from a callback once
    ended the step loop, and the failure path called the callback again, leaving every other
    request waiting forever."""
    def callback(output):
        raise raised()

    config = kt.GenerationConfig(max_new_tokens=4)
    bad = engine.submit(kt.Request(PROMPT, config, callback=callback))
    other = engine.submit(kt.Request("Hi", config))
    assert len(other.result(timeout=120).token_ids) > 0
    bad.result(timeout=120)  # its output is whole: only the callback failed
    assert engine.is_running


def test_callbacks_run_in_batch_calls_and_may_not_block_the_engine_thread(engine):
    """generate() / generate_outputs() run a Request's callback too (it was dropped); a
    blocking call inside a callback (a follow-up generate) is a RuntimeError there, logged,
    not a deadlock of every request."""
    seen: list[bool] = []
    config = kt.GenerationConfig(max_new_tokens=3)
    out = engine.generate_outputs([kt.Request(PROMPT, config, callback=lambda o: seen.append(
        o.finished))], use_tqdm=False)[0]
    assert seen and seen[-1] is True and len(out.token_ids) == 3
    seen.clear()
    assert engine.generate(kt.Request(PROMPT, config, callback=lambda o: seen.append(o.finished)))
    assert seen and seen[-1] is True

    errors: list[BaseException] = []

    def follow_up(output):
        if output.finished:
            try:
                engine.generate("A follow-up", config, use_tqdm=False)
            except RuntimeError as exc:
                errors.append(exc)

    first = engine.submit(kt.Request(PROMPT, config, callback=follow_up))
    assert len(first.result(timeout=120).token_ids) == 3
    assert errors and "engine thread" in str(errors[0])
    assert engine.generate("Hi", config)  # still serving


def test_waiting_timeout_fails_only_the_expired_request(model):
    with kt.Engine(model, num_device_blocks=64, max_num_seqs=1, waiting_timeout_ms=300,
                   generation_config=kt.GenerationConfig(max_new_tokens=40, ignore_eos=True)) as engine:
        running = engine.submit(PROMPT)
        next(iter(running))  # it holds the only sequence slot now
        waiting = engine.submit("A second prompt that cannot start in time")
        with pytest.raises(kt.api.outputs.RequestError) as info:
            waiting.result(timeout=60)
        assert isinstance(info.value.__cause__, kt.QueueTimeoutError)
        assert "waited over 300 ms (waiting_timeout_ms)" in str(info.value.__cause__)
        assert len(running.result(timeout=60).token_ids) == 40
        assert engine.generate("Hi", kt.GenerationConfig(max_new_tokens=2))
        assert engine.stats().num_free_kv_blocks == 64
