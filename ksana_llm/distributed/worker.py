"""A worker rank: load this rank's shard, then run every step rank 0 sends until told to stop.

Workers never sample and never schedule: rank 0 decides each step (block tables included, so
every rank's cache holds the same blocks, each with its own heads) and broadcasts it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from ksana_llm.distributed.runtime import (LaunchSpec, Runtime, broadcast_message,
                                           gather_messages, init_runtime)
from ksana_llm.distributed.runtime import shutdown_runtime
from ksana_llm.loader import load_hf_config
from ksana_llm.models.factory import load_model_module
from ksana_llm.runner.gc_heap import freeze_startup_heap
from ksana_llm.runner.model_runner import ModelRunner

logger = logging.getLogger("ksana_llm.worker")

# Messages from rank 0: ("runner", kwargs) once, then ("step", StepInput), ("draft",
# DraftInput: speculative decoding), ("lora", (adapter id, folder to register or None to
# unregister)) and ("lora_ready", adapter id: have its host copy for the next step) as the
# engine runs, both answered by every rank with its refusal or None (see `lora_error`),
# ("weights", WeightUpdate: check it and keep it) and ("weights_commit", apply it or not): a weight
# update; ("sleep", level) and ("wake_up", tags): sleep mode; each answered by every rank with its
# refusal or None; then ("stop", None).
RUNNER, STEP, DRAFT, LORA, LORA_READY, WEIGHTS, WEIGHTS_COMMIT, SLEEP, WAKE_UP, STOP = \
    "runner", "step", "draft", "lora", "lora_ready", "weights", "weights_commit", "sleep", \
    "wake_up", "stop"


def serve_steps(runtime: Runtime, module: torch.nn.Module, dtype: torch.dtype) -> None:
    runner: ModelRunner | None = None
    while True:
        kind, payload = broadcast_message(None, runtime)
        if kind == STOP:
            return
        if kind == RUNNER:
            runner = ModelRunner(module, device=runtime.device, dtype=dtype, host_outputs=False,
                                 **payload)
            # This process only serves steps from here on: its start-up objects (the shard,
            # the runner, the KV cache) stay out of the collector's full passes, which would
            # stall this rank's launches and with it every rank (see runner/gc_heap.py).
            freeze_startup_heap()
        elif kind == STEP and runner is not None:
            runner.execute(payload)
        elif kind == DRAFT and runner is not None:
            runner.propose(payload)
        elif kind == LORA and runner is not None:
            gather_messages(lora_error(runner, *payload), runtime)
        elif kind == LORA_READY and runner is not None:
            gather_messages(lora_error(runner, payload, None, ready=True), runtime)
        elif kind == WEIGHTS and runner is not None:
            gather_messages(refusal(runner.stage_weights, payload), runtime)
        elif kind == WEIGHTS_COMMIT and runner is not None:
            gather_messages(refusal(runner.commit_weights, payload), runtime)
        elif kind == SLEEP and runner is not None:
            gather_messages(refusal(runner.sleep, payload), runtime)
        elif kind == WAKE_UP and runner is not None:
            gather_messages(refusal(runner.wake_up, payload), runtime)
        else:
            raise RuntimeError(f"worker got an unexpected message {kind!r}")


def refusal(work: Callable[[Any], Any], payload: Any) -> str | None:
    """`work(payload)`'s failure as a message (a ValueError's text, else its type too), or
    None: a rank answers rank 0 with it instead of dying."""
    try:
        work(payload)
    except Exception as exc:  # noqa: BLE001 - the answer names it; rank 0 decides
        return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    return None


def lora_error(runner: ModelRunner, lora_id: int, path: str | None, *,
               ready: bool = False) -> str | None:
    """Register the LoRA adapter in `path` as `lora_id` (with path None unregister it; with
    `ready`, have its host copy for the next step: `ModelRunner.prepare_lora`); the refusal's
    message, or None. A refusal is an answer, not a failure: the rank keeps what it had and
    keeps serving (a file unreadable on this node, pinned memory: rank 0 unregisters the
    adapter everywhere)."""
    if ready:
        return refusal(runner.prepare_lora, lora_id)
    if path is None:
        return refusal(runner.unregister_lora, lora_id)
    return refusal(lambda adapter: runner.register_lora(*adapter), (lora_id, path))


def worker_main(rank: int, spec: LaunchSpec, started: Any = None) -> None:
    """Entry point of a worker process (spawned locally, or run by `ksana-llm serve` on a node
    that is not the master). A spawned one puts its rank on the `started` queue first."""
    if started is not None:
        started.put(rank)
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(message)s")
    runtime = init_runtime(spec, rank)
    try:
        module, dtype = load_model_module(spec.model_dir, device=runtime.device, dtype=spec.dtype,
                                          parallel=runtime.ctx, progress=False,
                                          quantization=spec.quantization,
                                          load_format=spec.load_format,
                                          hf_config=load_hf_config(spec.model_dir,
                                                                   spec.hf_overrides))
        serve_steps(runtime, module, dtype)
    except Exception:
        logger.exception("worker rank %d failed", rank)
        sys.exit(1)
    finally:
        shutdown_runtime()
