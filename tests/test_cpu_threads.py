"""The engine frees its caller's OpenMP worker threads (`runner.cpu_threads`), which would
otherwise compete with the step thread's for the cores (the speed it buys is measured by the
benchmarks' batch-1 decode, not here)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path

import torch

import ksana_llm as kt
from ksana_llm.runner.cpu_threads import loaded_libgomp, openmp_pool_releaser


# The OS name of the thread a test runs on. Linux threads inherit their creator's name, so
# the threads this one starts (its OpenMP workers, an engine's step thread) carry it too, and
# counting them by name leaves out threads that other tests' leftovers start or end meanwhile.
PROBE_NAME = b"omp-probe"
_PR_SET_NAME = 15


def os_threads() -> int:
    """How many of this process's threads carry the probe thread's name (it included)."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_bytes().strip() == PROBE_NAME
        except OSError:  # the thread ended while being counted
            continue
    return count


def name_this_thread() -> None:
    if ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, PROBE_NAME, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NAME) failed")


def on_new_thread(work: Callable[[], dict]) -> dict:
    """`work`'s result, run on a thread of its own (whose OpenMP pool no other test touched),
    named PROBE_NAME so that `os_threads` counts it and the threads it starts."""
    result: dict = {}

    def named_work() -> None:
        name_this_thread()
        result.update(work())

    thread = threading.Thread(target=named_work)
    thread.start()
    thread.join()
    return result


def parallel_region() -> None:
    """One torch op large enough to run on the OpenMP pool of the calling thread."""
    torch.ones(4_000_000).exp_()


def test_releasing_frees_the_calling_threads_openmp_workers():
    assert loaded_libgomp() is not None  # torch's Linux wheels run on their own libgomp
    release = openmp_pool_releaser()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # at least one worker beside the calling thread
    try:
        def work() -> dict:
            before = os_threads()
            parallel_region()
            with_pool = os_threads()
            return {"before": before, "with_pool": with_pool, "released": release(),
                    "after": os_threads()}

        result = on_new_thread(work)
    finally:
        torch.set_num_threads(threads)
    assert result["with_pool"] > result["before"]
    assert result["released"] and result["after"] == result["before"]


def test_engine_frees_the_pool_of_the_thread_that_creates_it_and_submits():
    """The thread that loads the model and creates the engine has a pool from loading; the
    engine frees it, and frees it again when that thread submits after running torch: freeing
    it once more then finds nothing to free."""
    release = openmp_pool_releaser()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def work() -> dict:
            model = kt.Model.from_pretrained(None, device="cpu", dtype="float32",
                                             progress=False)
            parallel_region()
            config = kt.GenerationConfig(max_new_tokens=2, ignore_eos=True)
            with kt.Engine(model, generation_config=config) as engine:
                created = os_threads()
                release()
                created_then_released = os_threads()
                parallel_region()
                with_pool = os_threads()
                engine.generate_outputs([[1, 2, 3]], use_tqdm=False)
                submitted = os_threads()
                release()
                submitted_then_released = os_threads()
            return {"created": (created, created_then_released), "with_pool": with_pool,
                    "submitted": (submitted, submitted_then_released)}

        result = on_new_thread(work)
    finally:
        torch.set_num_threads(threads)
    assert result["created"][0] == result["created"][1]
    assert result["with_pool"] > result["created"][1]
    assert result["submitted"][0] == result["submitted"][1]
