"""A parallel engine's failures on CPU with gloo, real worker processes: sizes that cannot split
are clear errors, a dead worker fails the engine fast, an engine refused after its ranks started
leaves no worker behind, and a script read on stdin still starts its workers."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.distributed.launch import await_started
from ksana_llm.generation_config import GenerationConfig
from tests.family_harness import greedy_trace, hf_reference
from tests.parallel_models import build

pytestmark = pytest.mark.timeout(300)


def test_invalid_parallel_sizes_are_clear_errors(tmp_path):
    build("llama", tmp_path)  # 4 heads
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        Model.from_pretrained(tmp_path, device="cpu", progress=False, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Model.from_pretrained(tmp_path, device="cpu", progress=False, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 is more than"):
        Model.from_pretrained(tmp_path, device="cpu", progress=False, pipeline_parallel_size=3)


def test_a_dead_worker_fails_the_engine_fast(tmp_path):
    build("llama-tp3", tmp_path)
    model = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                  tensor_parallel_size=3)
    engine = kt.Engine(model, generation_config=GenerationConfig(max_new_tokens=4),
                       num_device_blocks=32)
    try:
        assert len(engine.generate_outputs([[5, 6, 7]])[0].token_ids) == 4
        os.kill(model.workers[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not engine.is_running
        start = time.monotonic()
        with pytest.raises(Exception, match="worker"):
            engine.generate_outputs([[5, 6, 7]])
        assert time.monotonic() - start < 10
        # The rank that lives on waits in a collective that never completes: shutting down
        # stops it at once (it used to be given 30 s to leave, each such rank in turn).
        start = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - start < 15
        assert not any(worker.is_alive() for worker in model.workers)
    finally:
        engine.shutdown()


def test_an_engine_refused_after_loading_leaves_no_worker_behind(tmp_path):
    """Settings refused once the ranks are up (async scheduling, an adapter folder that is not
    one): the ValueError, no worker process left, and the next parallel engine in this process
    starts (the process group was left too)."""
    hf = build("llama", tmp_path)
    settings = {"device": "cpu", "dtype": "float32", "tensor_parallel_size": 2,
                "num_device_blocks": 32}
    for refused, message in [({"async_scheduling": True}, "async_scheduling needs a single-rank"),
                             ({"lora_modules": {"a": str(tmp_path / "none")}, "max_loras": 1},
                              "LoRA adapter .* is not a folder")]:
        with pytest.raises(ValueError, match=message):
            kt.Engine(str(tmp_path), **settings, **refused)
        assert not [p for p in multiprocessing.active_children()
                    if p.name.startswith("ksana-llm-rank")]
    expected = greedy_trace(hf_reference(hf), [5, 6, 7], 4)[0][3:]
    with kt.Engine(str(tmp_path), **settings) as engine:
        assert engine.generate_outputs([[5, 6, 7]], GenerationConfig(
            max_new_tokens=4, ignore_eos=True), use_tqdm=False)[0].token_ids == expected


STDIN_SCRIPT = """
import sys
import ksana_llm as kt
engine = kt.Engine(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2,
                   num_device_blocks=32)
print(engine.generate_outputs([[5, 6, 7]], kt.GenerationConfig(max_new_tokens=6,
                                                                ignore_eos=True))[0].token_ids)
engine.shutdown()
"""


def test_a_parallel_engine_from_a_script_read_on_stdin(tmp_path):
    """`python - < script`: spawn would make every worker re-run a main script named "<stdin>",
    so they all died and rank 0 waited out the 300 s rendezvous."""
    hf = build("llama", tmp_path)
    expected = greedy_trace(hf_reference(hf), [5, 6, 7], 6)[0][3:]
    done = subprocess.run([sys.executable, "-", str(tmp_path)], input=STDIN_SCRIPT, text=True,
                          capture_output=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(expected)


def test_a_worker_that_dies_before_starting_fails_the_launch_at_once():
    context = multiprocessing.get_context("spawn")
    started = context.Queue()
    dying = context.Process(target=sys.exit, args=(3,), daemon=True)
    dying.start()
    begin = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 5 exited with code 3 before it started"):
        await_started({5: dying}, started, timeout_s=120)
    assert time.monotonic() - begin < 30
