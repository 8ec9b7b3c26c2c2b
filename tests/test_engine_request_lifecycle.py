"""Requests' lifecycle through the Python API, on the real default model, the ways real
callers get it wrong: configs changed after submit, the queue bound under KV pressure, callbacks
that raise or requests that fail, streams left early, interrupted batch calls, ids reused right
after an abort, asyncio handles read blocking (and blocking ones awaited), text streams of
several sequences. Each must end in a clear error or a finished request, and the engine must go
on serving everyone else."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import ksana_llm as kt
from tests.engine_fixtures import engine_fixture, wait_until_idle

PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"
LONG = kt.GenerationConfig(max_new_tokens=3000, ignore_eos=True)


engine = engine_fixture(generation_config=kt.GenerationConfig(max_new_tokens=8),
                        num_device_blocks=256)


def test_a_config_changed_or_reused_after_submit_reaches_no_request_in_flight(engine):
    """Each request keeps its own copy (transformers and vLLM copy too): one config reused with
    another max_new_tokens, or broken after submit, changes nothing already submitted."""
    config = kt.GenerationConfig(max_new_tokens=12, ignore_eos=True)
    first = engine.submit(kt.Request(PROMPT, config))
    config.max_new_tokens = 2
    second = engine.submit(kt.Request(PROMPT, config))
    config.stop_token_ids = None  # would have crashed the step loop for every request
    assert [len(first.result().token_ids), len(second.result().token_ids)] == [12, 2]
    assert engine.is_running
    base = kt.GenerationConfig(stop=["x"])
    copy = base.replace(max_new_tokens=5)
    copy.stop.append("y")
    assert base.stop == ["x"]


def test_the_queue_bound_holds_when_requests_wait_for_kv_memory(default_model):
    """Free sequence slots are no place for requests the full KV pool holds back: while one
    request holds 13 of the 16 blocks, the third request that cannot start is refused
    (max_queue_size=2), not accepted up to max_num_seqs."""
    def _wait_for(check) -> None:
        # Read what the step loop last published (stats() also counts requests it has not
        # picked up yet, which no step has seen wait).
        deadline = time.monotonic() + 60
        while not check(engine) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert check(engine)

    config = kt.GenerationConfig(max_new_tokens=50, ignore_eos=True)
    with kt.Engine(default_model, num_device_blocks=16, max_queue_size=2,
                   enable_prefix_caching=False) as engine:
        prompt = (engine.tokenizer.encode("word " * 200) * 2)[:200]  # 13 blocks of 16
        handles = [engine.submit(kt.Request(prompt, config))]
        _wait_for(lambda e: e._num_running == 1)
        for waiting in (1, 2):
            handles.append(engine.submit(kt.Request(prompt, config)))
            _wait_for(lambda e: e._num_waiting == waiting)
        with pytest.raises(kt.QueueFullError):
            engine.submit(kt.Request(prompt, config))
        assert [len(h.result(timeout=120).token_ids) for h in handles] == [50, 50, 50]


def test_a_request_that_fails_tells_its_callback_it_ended(default_model):
    """A callback is the guide's way to receive results: a request that times out in the queue,
    or is cut off by shutdown, gives it a last, finished output ("abort") besides the error."""
    seen: dict[str, list] = {"queued": [], "running": []}

    def record(name):
        return lambda out: seen[name].append((out.finished, out.finish_reason,
                                              out.error is not None))

    engine = kt.Engine(default_model, max_num_seqs=1, waiting_timeout_ms=200, num_device_blocks=64)
    try:
        running = engine.submit(kt.Request(PROMPT, LONG, callback=record("running")))
        queued = engine.submit(kt.Request(PROMPT, LONG, callback=record("queued")))
        with pytest.raises(kt.RequestError):
            queued.result(timeout=60)
        assert seen["queued"] == [(True, "abort", True)]
    finally:
        engine.shutdown()
    with pytest.raises(kt.RequestError):
        running.result(timeout=60)
    assert seen["running"][-1] == (True, "abort", True)
    assert all(not finished and not failed for finished, _, failed in seen["running"][:-1])


def test_a_request_the_engine_thread_refuses_fails_alone(engine, monkeypatch):
    """Defense in depth: should anything slip past validation and raise while the engine thread
    queues a request, only that request fails (it once took the engine down with it)."""
    other = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=12, ignore_eos=True)))
    core = engine._core
    real = core._detokenizer

    def refuse(seq, **kw):
        if seq.request_id == "refused":
            raise TypeError("a setting the tokenizer cannot take")
        return real(seq, **kw)

    monkeypatch.setattr(core, "_detokenizer", refuse)
    with pytest.raises(kt.RequestError, match="tokenizer cannot take"):
        engine.submit(kt.Request(PROMPT, request_id="refused")).result(timeout=60)
    assert len(other.result(timeout=60).token_ids) == 12 and engine.is_running
    assert wait_until_idle(engine) and engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


@pytest.mark.parametrize("error", [RuntimeError("callback bug"), SystemExit(3)])
def test_a_raising_callback_leaves_the_engine_serving(engine, error):
    """sys.exit() in a callback once ended the step loop for every request."""
    def callback(out):
        raise error

    first = engine.submit(kt.Request(PROMPT, callback=callback)).result(timeout=60)
    assert first.finished and len(first.token_ids) == 8
    assert engine.is_running and engine.generate(PROMPT) == first.text


def test_leaving_a_stream_early_aborts_the_request(engine):
    stream = engine.generate(PROMPT, LONG, stream=True)
    assert next(stream)
    assert engine.stats().num_running == 1
    stream.close()  # what `break` out of a for loop does once the iterator is dropped
    assert wait_until_idle(engine, timeout=30)
    for _ in engine.generate(PROMPT, LONG, stream=True):
        break
    assert wait_until_idle(engine, timeout=30)
    # Dropped before its first delta: the request was submitted all the same.
    unread = engine.generate(PROMPT, LONG, stream=True)
    del unread
    assert wait_until_idle(engine, timeout=30)
    # A named stream left by `break` inside a `with` block: the block's end aborts it.
    with engine.generate(PROMPT, LONG, stream=True) as stream:
        for _ in stream:
            break
    assert wait_until_idle(engine, timeout=30)
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


def test_interrupted_generate_outputs_aborts_what_it_queued(engine, monkeypatch):
    """Ctrl-C while generate_outputs waits: the requests it queued stop too."""
    calls = {"n": 0}
    real = type(engine)._finish_one

    def interrupted(handle, progress):
        calls["n"] += 1
        raise KeyboardInterrupt

    monkeypatch.setattr(type(engine), "_finish_one", staticmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):
        engine.generate_outputs([PROMPT, "Hello there"], LONG, use_tqdm=False)
    monkeypatch.setattr(type(engine), "_finish_one", staticmethod(real))
    assert calls["n"] == 1 and wait_until_idle(engine, timeout=30)


def test_generate_outputs_waits_for_room_without_spinning(default_model, monkeypatch):
    """Other callers' requests fill the queue: generate_outputs sleeps until there is room
    (woken after steps), instead of retrying in a loop that starves the engine thread."""
    config = kt.GenerationConfig(max_new_tokens=40, ignore_eos=True)
    with kt.Engine(default_model, num_device_blocks=64, max_num_seqs=1, max_queue_size=1) as engine:
        others = [engine.submit(kt.Request(PROMPT, config)) for _ in range(2)]  # running + waiting
        attempts = {"n": 0}
        real = engine._enqueue_many

        def counted(pending):
            attempts["n"] += 1
            return real(pending)

        monkeypatch.setattr(engine, "_enqueue_many", counted)
        result = []
        worker = threading.Thread(target=lambda: result.append(
            engine.generate_outputs(["Hi"], kt.GenerationConfig(max_new_tokens=2), use_tqdm=False)))
        worker.start()
        worker.join(timeout=180)
        assert not worker.is_alive() and len(result[0][0].token_ids) >= 1
        assert all(len(h.result(timeout=60).token_ids) == 40 for h in others)
        # At most one attempt per engine step (80 of them), not thousands.
        assert attempts["n"] <= 90, attempts


def test_an_abort_for_a_finished_request_spares_a_retry_with_its_id(engine):
    engine.submit(kt.Request(PROMPT, request_id="retry-me")).result(timeout=60)
    # A callback that sleeps keeps the engine thread busy, so the abort and the retry below
    # reach it together (it reads new requests before aborts).
    slow = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=2),
                                    callback=lambda _: time.sleep(1.0)))
    time.sleep(0.3)
    engine.abort("retry-me")
    retry = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=4, ignore_eos=True),
                                     request_id="retry-me"))
    out = retry.result(timeout=60)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    slow.result(timeout=60)


def test_an_asyncio_handle_is_not_read_blocking(engine):
    async def main():
        handle = engine.submit(kt.Request(PROMPT), loop=asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="aresult"):
            handle.result(timeout=5)
        return await handle.aresult()

    assert asyncio.run(main()).finished


def test_a_request_whose_event_loop_closed_is_aborted(engine):
    """Submitted for an asyncio loop that then closed (`asyncio.run` returned without awaiting
    it), with no callback: nobody can read its outputs, so it stops instead of running on to
    its token limit; so does a best_of one, whose outputs only come at its end. One with a
    callback is still heard, and runs on."""
    heard = []
    best_of = kt.GenerationConfig(max_new_tokens=3000, ignore_eos=True, best_of=2,
                                  do_sample=True, seed=3)

    async def forget():
        loop = asyncio.get_running_loop()
        return (engine.submit(kt.Request(PROMPT, LONG), loop=loop),
                engine.submit(kt.Request(PROMPT, best_of), loop=loop),
                engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=6),
                                         callback=heard.append), loop=loop))

    *forgotten, with_callback = asyncio.run(forget())
    assert wait_until_idle(engine, timeout=60)
    for handle in forgotten:
        assert handle.output.finish_reason == "abort" and len(handle.output.token_ids) < 300
    assert heard and heard[-1].finish_reason == "length" and len(heard[-1].token_ids) == 6
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
    # Finished, never awaited: result() gives the output as the README says (it raised).
    assert with_callback.result().token_ids == heard[-1].token_ids
    assert all(handle.result().finish_reason == "abort" for handle in forgotten)


def test_a_text_stream_of_several_sequences_is_refused_not_cut_to_one(engine):
    """generate(stream=True), stream_async and generate_async carry one sequence's text: a
    request for n > 1 would lose the others unseen, so it is a ValueError naming the field,
    before anything is queued; deltas() streams them all, generate_output_async returns them."""
    config = kt.GenerationConfig(max_new_tokens=4, num_return_sequences=2, do_sample=True,
                                 seed=1)
    assert wait_until_idle(engine)
    finished = engine.stats().num_finished
    with pytest.raises(ValueError, match=r"num_return_sequences: .*\.deltas\(\)"):
        engine.generate(PROMPT, config, stream=True)

    async def main():
        with pytest.raises(ValueError, match="num_return_sequences"):
            async for _ in engine.stream_async(PROMPT, config):
                pass
        # generate_async returns one text too: the second sample is refused, not dropped.
        with pytest.raises(ValueError, match=r"num_return_sequences: .*generate_output_async"):
            await engine.generate_async(PROMPT, config)

    asyncio.run(main())
    assert wait_until_idle(engine)
    assert engine.stats().num_finished == finished  # not even queued and aborted
    both = asyncio.run(engine.generate_output_async(PROMPT, config))
    assert len(both.sequences) == 2
    by_index = {0: "", 1: ""}
    handle = engine.submit(kt.Request(PROMPT, config))
    for delta in handle.deltas():
        by_index[delta.index] += delta.text
    assert [by_index[i] for i in (0, 1)] == [s.text for s in handle.result().sequences]


def test_a_blocking_handle_awaited_says_how_to_submit_for_asyncio(engine):
    async def main():
        handle = engine.submit(kt.Request(PROMPT))  # no loop=: a blocking handle
        with pytest.raises(RuntimeError, match=r"loop=asyncio.get_running_loop\(\)"):
            await handle.aresult()
        return handle

    assert asyncio.run(main()).result(timeout=60).finished  # still readable the blocking way


def test_a_loop_or_callback_of_the_wrong_type_is_refused_at_submit(engine):
    """Both are used on the engine thread: a string given as `loop` once killed the step loop
    there, and the callers already waiting waited forever."""
    waiting = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=12,
                                                                   ignore_eos=True)))
    with pytest.raises(ValueError, match="loop must be an asyncio event loop, got str"):
        engine.submit(kt.Request(PROMPT), loop="not a loop")
    with pytest.raises(ValueError, match="callback must be callable, got int"):
        engine.submit(kt.Request(PROMPT, callback=5))
    assert len(waiting.result(timeout=60).token_ids) == 12 and engine.is_running


def test_asyncio_calls_wait_for_room_in_a_full_queue_as_blocking_calls_do(default_model):
    """generate_async / generate_output_async / stream_async wait while the queue is full (they
    raised QueueFullError at once, where generate_outputs waited); submit() still raises."""
    config = kt.GenerationConfig(max_new_tokens=3, ignore_eos=True)
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    with kt.Engine(default_model, max_num_seqs=1, max_queue_size=2, num_device_blocks=64,
                   enable_prefix_caching=False) as engine:
        expected = [o.text for o in engine.generate_outputs(prompts, config, use_tqdm=False)]

        async def streamed(prompt: str) -> str:
            return "".join([delta async for delta in engine.stream_async(prompt, config)])

        async def main() -> list:
            texts = [engine.generate_async(p, config) for p in prompts[:3]]
            outputs = [engine.generate_output_async(p, config) for p in prompts[3:6]]
            streams = [streamed(p) for p in prompts[6:]]
            return await asyncio.gather(*texts, *outputs, *streams)

        results = asyncio.run(main())
        assert [r if isinstance(r, str) else r.text for r in results] == expected
        assert wait_until_idle(engine)
        assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


def test_a_batch_config_reaches_a_request_without_its_own(engine):
    config = kt.GenerationConfig(max_new_tokens=5, ignore_eos=True)
    outputs = engine.generate_outputs([kt.Request(PROMPT), PROMPT], config, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [5, 5]
    assert outputs[0].token_ids == outputs[1].token_ids
    with pytest.raises(ValueError, match="a Request carries its own"):
        engine.generate_outputs([kt.Request(PROMPT, config)], config, use_tqdm=False)


def test_request_fields_of_the_wrong_type_are_value_errors(engine):
    import threading as threads

    cases = [(kt.Request(PROMPT, export_kv="yes"), "export_kv must be True or False"),
             (kt.Request(PROMPT, additional_params=[1, 2]), "additional_params must be a dict"),
             (kt.Request(PROMPT, prompt_text=5), "prompt_text must be a string"),
             (kt.Request(PROMPT, messages="junk"), "messages must be a list of dicts"),
             (kt.Request(PROMPT, kt.GenerationConfig(extra_args={"lock": threads.Lock()})),
              "every value must be copyable")]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.submit(request)
    assert len(engine.generate_outputs(PROMPT, use_tqdm=False)[0].token_ids) == 8
