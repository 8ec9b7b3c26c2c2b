"""The engine thread itself: a step loop that fails, a thread that cannot start, the GPU it
names, and a script that ends without `shutdown()`: callers get errors, never a hang or a crash
at exit."""

from __future__ import annotations

import threading

import pytest
import torch

import ksana_llm as kt

PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


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
