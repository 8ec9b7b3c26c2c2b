"""The Python API used the ways real callers misuse it, on the real default model: settings of the
wrong type or changed after a config was built, configs beam search cannot finish, streams left
early, interrupted batch calls, ids reused right after an abort, asyncio handles read blocking,
and prompts as numpy arrays or torch tensors. Each must give a clear error or a finished request,
and the engine must go on serving everyone else."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

import ksana_llm as kt
from tests.engine_fixtures import engine_fixture

PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"
LONG = kt.GenerationConfig(max_new_tokens=3000, ignore_eos=True)


engine = engine_fixture(generation_config=kt.GenerationConfig(max_new_tokens=8),
                        num_device_blocks=256)


def _idle(engine: kt.Engine, timeout: float = 60.0) -> bool:
    """Whether the engine has nothing running or waiting within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("config, field", [
    ({"skip_special_tokens": 0}, "skip_special_tokens"),  # killed the engine thread once
    ({"do_sample": "no"}, "do_sample"),
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"temperature": float("inf")}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"num_beams": 2, "length_penalty": float("-inf")}, "length_penalty"),
    ({"num_beams": 2, "early_stopping": 1.0}, "early_stopping"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"logit_bias": {"²": 1.0}}, "logit_bias"),
])
def test_settings_of_the_wrong_type_are_refused_by_name(engine, config, field):
    other = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=12, ignore_eos=True)))
    with pytest.raises(ValueError, match=field):
        kt.GenerationConfig(**config)
    with pytest.raises(ValueError, match=field):
        engine.generate(PROMPT, config)
    assert len(other.result(timeout=60).token_ids) == 12 and engine.is_running


@pytest.mark.parametrize("field, value", [
    ("stop", "Paris"), ("seed", 1.5), ("stop_token_ids", 5), ("max_new_tokens", None),
    ("max_new_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("num_beams", 0),
    ("logprobs", 10**6), ("skip_special_tokens", 1),
])
def test_a_config_changed_after_it_was_built_is_checked_again(engine, field, value):
    """transformers validates a GenerationConfig on every generate(); so does submit. Set on the
    engine's default config, the same value is refused for every request that uses it."""
    config = kt.GenerationConfig(max_new_tokens=4, do_sample=True)
    setattr(config, field, value)
    other = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=12, ignore_eos=True)))
    with pytest.raises(ValueError, match=field):
        engine.generate(PROMPT, config)
    with pytest.raises(ValueError, match=field):
        engine.submit(kt.Request(PROMPT, config))
    assert len(other.result(timeout=60).token_ids) == 12 and engine.is_running


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


def test_numpy_token_ids_are_taken_in_every_token_id_field():
    ids = np.array([5, 6], dtype=np.int64)
    config = kt.GenerationConfig(bad_words_ids=[list(ids)], allowed_token_ids=list(ids),
                                 logit_bias={ids[0]: np.float32(1.5)}, stop_token_ids=list(ids))
    assert config.bad_words_ids == [[5, 6]] and config.allowed_token_ids == [5, 6]
    assert config.logit_bias == {5: 1.5} and config.stop_token_ids == [5, 6]
    assert all(type(t) is int for t in [*config.allowed_token_ids, *config.logit_bias])


def test_transformers_names_we_lack_are_value_errors_and_configs_may_come_as_a_tuple(engine):
    for name in ("max_length", "stop_strings", "pad_token_id"):
        with pytest.raises(ValueError, match=f"unknown generation parameter.*{name}"):
            kt.GenerationConfig(**{name: 5})
    configs = (kt.GenerationConfig(max_new_tokens=2), kt.GenerationConfig(max_new_tokens=3))
    outs = engine.generate_outputs([PROMPT, PROMPT], configs, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [2, 3]


def test_a_priority_the_fifo_scheduler_would_ignore_is_refused(engine):
    """As vLLM: a priority needs scheduler="priority"; 0 (the default) is fine."""
    with pytest.raises(ValueError, match="priority 3 needs an engine with scheduler='priority'"):
        engine.submit(kt.Request(PROMPT, priority=3))
    assert engine.submit(kt.Request(PROMPT, priority=0)).result(timeout=60).token_ids


def test_engine_default_config_as_a_dict_or_of_the_wrong_type(default_model):
    with kt.Engine(default_model, generation_config={"max_new_tokens": 3, "ignore_eos": True},
                   num_device_blocks=32) as engine:
        assert len(engine.generate_outputs(PROMPT, use_tqdm=False)[0].token_ids) == 3
    for bad, match in (("greedy", "generation_config"), ({"max_new_tokenz": 3}, "max_new_tokenz")):
        with pytest.raises(ValueError, match=match):
            kt.Engine(default_model, generation_config=bad, num_device_blocks=32)


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
    assert _idle(engine) and engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


@pytest.mark.parametrize("error", [RuntimeError("callback bug"), SystemExit(3)])
def test_a_raising_callback_leaves_the_engine_serving(engine, error):
    """sys.exit() in a callback once ended the step loop for every request."""
    def callback(out):
        raise error

    first = engine.submit(kt.Request(PROMPT, callback=callback)).result(timeout=60)
    assert first.finished and len(first.token_ids) == 8
    assert engine.is_running and engine.generate(PROMPT) == first.text


@pytest.mark.parametrize("config", [
    # Every finished hypothesis scores below transformers' -1e9 filler.
    kt.GenerationConfig(max_new_tokens=12, num_beams=2, length_penalty=-20.0, ignore_eos=True),
])
def test_beam_search_always_finishes_with_an_answer(engine, config):
    out = engine.submit(kt.Request("Write a long story about a dragon.", config)).result(timeout=120)
    assert out.finished and out.token_ids and len(out.sequences) == 1
    assert _idle(engine)


@pytest.mark.parametrize("config", [
    # The only allowed token is EOS, which min_new_tokens holds back (token 0 came out).
    {"allowed_token_ids": [2], "min_new_tokens": 2},
    {"allowed_token_ids": [2], "min_new_tokens": 2, "num_beams": 2},
    {"allowed_token_ids": [578, 2], "bad_words_ids": [[578]], "min_new_tokens": 3},
    {"allowed_token_ids": [578, 11], "stop_token_ids": [11], "bad_words_ids": [[578]],
     "min_new_tokens": 1, "ignore_eos": True},
])
def test_allowed_tokens_that_min_new_tokens_all_holds_back_are_refused(engine, config):
    with pytest.raises(ValueError, match="allowed_token_ids .* nothing could be generated"):
        engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=4, **config)))
    # Ignoring EOS, it may be generated: no refusal, and only allowed ids come out.
    out = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(
        max_new_tokens=3, allowed_token_ids=[2], min_new_tokens=2, ignore_eos=True))).result(60)
    assert out.token_ids == [2, 2, 2]


def test_a_lone_eos_bad_word_bans_nothing_when_eos_is_ignored(engine, default_model):
    """transformers' rule held only while the request stopped at EOS."""
    eos = default_model.eos_token_ids[0]
    config = kt.GenerationConfig(max_new_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    plain = engine.submit(kt.Request(PROMPT, config)).result(timeout=60)
    banned = engine.submit(kt.Request(PROMPT, config.replace(bad_words_ids=[[eos]]))).result(60)
    assert plain.token_ids == banned.token_ids == [eos] * 3


def test_leaving_a_stream_early_aborts_the_request(engine):
    stream = engine.generate(PROMPT, LONG, stream=True)
    assert next(stream)
    assert engine.stats().num_running == 1
    stream.close()  # what `break` out of a for loop does once the iterator is dropped
    assert _idle(engine, timeout=30)
    for _ in engine.generate(PROMPT, LONG, stream=True):
        break
    assert _idle(engine, timeout=30)
    # Dropped before its first delta: the request was submitted all the same.
    unread = engine.generate(PROMPT, LONG, stream=True)
    del unread
    assert _idle(engine, timeout=30)


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
    assert calls["n"] == 1 and _idle(engine, timeout=30)


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


@pytest.mark.parametrize("request_id", ["", 7])
def test_request_ids_are_non_empty_strings(engine, request_id):
    with pytest.raises(ValueError, match="request_id"):
        engine.submit(kt.Request(PROMPT, request_id=request_id))


def test_an_asyncio_handle_is_not_read_blocking(engine):
    async def main():
        handle = engine.submit(kt.Request(PROMPT), loop=asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="aresult"):
            handle.result(timeout=5)
        return await handle.aresult()

    assert asyncio.run(main()).finished


def test_a_text_stream_of_several_sequences_is_refused_not_cut_to_one(engine):
    """generate(stream=True) and stream_async carry one sequence's text: a request for n > 1
    would lose the others unseen, so it is a ValueError naming the field, before anything is
    queued; deltas() streams them all."""
    config = kt.GenerationConfig(max_new_tokens=4, num_return_sequences=2, do_sample=True,
                                 seed=1)
    assert _idle(engine)
    finished = engine.stats().num_finished
    with pytest.raises(ValueError, match=r"num_return_sequences: .*\.deltas\(\)"):
        engine.generate(PROMPT, config, stream=True)

    async def main():
        with pytest.raises(ValueError, match="num_return_sequences"):
            async for _ in engine.stream_async(PROMPT, config):
                pass

    asyncio.run(main())
    assert _idle(engine)
    assert engine.stats().num_finished == finished  # not even queued and aborted
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


def test_prompts_as_numpy_arrays_torch_tensors_and_tuples(engine):
    ids = engine.tokenizer.encode(PROMPT)
    expected = engine.generate(ids)
    assert engine.generate(np.array(ids)) == expected
    assert engine.generate(torch.tensor(ids)) == expected
    assert engine.generate(tuple(ids)) == expected
    assert engine.generate(torch.tensor([ids, ids]), use_tqdm=False) == [expected, expected]
    # numpy scalars in a config are numbers like any other.
    config = kt.GenerationConfig(max_new_tokens=np.int64(8), temperature=np.float32(1.0))
    assert engine.generate(ids, config) == expected
    for bad in (np.array(ids, dtype=np.float32), torch.tensor([True, False]), np.array([], dtype=np.int64)):
        with pytest.raises(ValueError, match="prompt"):
            engine.generate(bad)


def test_a_vanishing_temperature_is_greedy(engine):
    greedy = engine.generate(PROMPT)
    tiny = kt.GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1e-38, seed=1)
    assert engine.generate(PROMPT, tiny) == greedy


def test_chat_template_kwargs_must_be_a_dict(engine):
    conversation = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        engine.chat(conversation, chat_template_kwargs=5)


def test_a_step_loop_failure_fails_the_calls_it_had_taken(default_model, monkeypatch):
    """A control call (reset_prefix_cache, LoRA loading) taken by the engine thread in the same
    pass as an abort that fails the loop gets the engine's failure, not a wait forever."""
    from concurrent.futures import Future

    engine = kt.Engine(default_model, num_device_blocks=16)
    try:
        def broken_abort(request_id):
            raise RuntimeError("a bug in abort")

        monkeypatch.setattr(engine._core, "abort", broken_abort)
        taken: Future = Future()
        with engine._wake:  # both land in one pass of the loop
            engine.abort("nobody")
            engine._commands.append((engine._core.block_manager.reset_prefix_cache, taken))
        with pytest.raises(RuntimeError, match="a bug in abort"):
            taken.result(timeout=30)
        assert not engine.is_running
    finally:
        engine.shutdown()


def test_an_engine_thread_that_cannot_start_fails_its_callers(default_model, monkeypatch):
    """The engine thread binds its device before the first step (on the first H200 run,
    torch.cuda.set_device refused a device without an index there): a failure at that point
    fails every caller with it, and later calls at once, instead of leaving them waiting for
    steps that never come."""
    import threading

    started = threading.Event()

    def broken_bind(self):
        started.wait(30)  # a request is queued first, so it is one the failure must reach
        raise ValueError("Expected a torch.device with a specified index")

    monkeypatch.setattr(kt.Engine, "_bind_device", broken_bind)
    engine = kt.Engine(default_model, num_device_blocks=16)
    try:
        handle = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=2)))
        started.set()
        with pytest.raises(kt.RequestError, match="specified index"):
            handle.result(timeout=30)
        assert not engine.is_running and isinstance(engine.failure, ValueError)
        with pytest.raises(kt.EngineDeadError, match="specified index"):
            engine.generate(PROMPT, kt.GenerationConfig(max_new_tokens=2))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("device, index", [("cuda", 0), ("cuda:1", 1)])
def test_the_engine_thread_names_its_gpu_by_index(monkeypatch, device, index):
    """torch.cuda.set_device takes only a device with an index, and a model's device is often
    a bare "cuda" (the bug that stopped the first H200 run): _bind_device hands it the current
    device's index then. torch's own index check stands in for the call, which needs a GPU."""
    from types import SimpleNamespace

    from torch._utils import _get_device_index

    bound = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: bound.append(_get_device_index(d)))  # raises without an index
    engine = SimpleNamespace(_core=SimpleNamespace(runner=SimpleNamespace(
        device=torch.device(device))))
    kt.Engine._bind_device(engine)
    assert bound == [index]


def test_a_gpu_device_is_resolved_with_its_index(monkeypatch):
    """"cuda" and "auto" on a GPU machine name the current GPU with its index, as its tensors
    report it (cuda:1 == a tensor's device; bare cuda never is). torch.cuda's answers are
    stood in for (no GPU here); the resolution is ours."""
    from ksana_llm.api.model import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device(None) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")


_EXIT_MID_STEP = """
import ksana_llm as kt
engine = kt.Engine(kt.Model.from_pretrained(None, device="cpu", dtype="float32", progress=False))
for delta in engine.generate("Once upon a time", kt.GenerationConfig(max_new_tokens=3000,
                                                                     ignore_eos=True), stream=True):
    break
engine.submit(kt.Request("Tell me a story", kt.GenerationConfig(max_new_tokens=3000,
                                                                 ignore_eos=True)))
print("leaving with requests running", flush=True)
"""


def test_a_script_that_ends_without_shutdown_exits_cleanly():
    """The usual script: no shutdown(), a stream left early, a request still running. The
    engine's exit hook stops its loop before the interpreter tears the step thread down; without
    it the process aborted mid-forward (SIGABRT, "terminate called without an active
    exception")."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", _EXIT_MID_STEP], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert "leaving with requests running" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
