"""A worker rank: load this rank's shard, then run every step rank 0 sends until told to stop.

Workers never sample and never schedule: rank 0 decides each step (block tables included, so
every rank's cache holds the same blocks, each with its own heads) and broadcasts it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from ksana_llm.distributed.runtime import (LaunchSpec, Runtime, broadcast_message,
                                           gather_messages, init_runtime)
from ksana_llm.distributed.runtime import shutdown_runtime
from ksana_llm.loader import load_hf_config
from ksana_llm.models.factory import load_model_module
from ksana_llm.runner.model_runner import ModelRunner

logger = logging.getLogger("ksana_llm.worker")

# Messages from rank 0: ("runner", kwargs) once, then ("step", StepInput), ("draft",
# DraftInput: speculative decoding), ("lora", (adapter id, folder to register or None to
# unregister)) and ("lora_ready", adapter id: have its host copy for the next step) as the
# engine runs, both answered by every rank with its refusal or None (see `lora_error`), then
# ("stop", None).
RUNNER, STEP, DRAFT, LORA, LORA_READY, STOP = \
    "runner", "step", "draft", "lora", "lora_ready", "stop"


def serve_steps(runtime: Runtime, module: torch.nn.Module, dtype: torch.dtype) -> None:
    runner: ModelRunner | None = None
    while True:
        kind, payload = broadcast_message(None, runtime)
        if kind == STOP:
            return
        if kind == RUNNER:
            runner = ModelRunner(module, device=runtime.device, dtype=dtype, **payload)
        elif kind == STEP and runner is not None:
            runner.execute(payload)
        elif kind == DRAFT and runner is not None:
            runner.propose(payload)
        elif kind == LORA and runner is not None:
            gather_messages(lora_error(runner, *payload), runtime)
        elif kind == LORA_READY and runner is not None:
            gather_messages(lora_error(runner, payload, None, ready=True), runtime)
        else:
            raise RuntimeError(f"worker got an unexpected message {kind!r}")


def lora_error(runner: ModelRunner, lora_id: int, path: str | None, *,
               ready: bool = False) -> str | None:
    """Register the LoRA adapter in `path` as `lora_id` (with path None unregister it; with
    `ready`, have its host copy for the next step: `ModelRunner.prepare_lora`); the refusal's
    message, or None. A refusal is an answer, not a failure: the rank keeps what it had and
    keeps serving."""
    try:
        if ready:
            runner.prepare_lora(lora_id)
        elif path is None:
            runner.unregister_lora(lora_id)
        else:
            runner.register_lora(lora_id, path)
    except Exception as exc:  # noqa: BLE001 - any failure here (a file unreadable on this node,
        # pinned memory) is this adapter's, not the worker's: rank 0 unregisters it everywhere
        return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    return None


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
                                          hf_config=load_hf_config(spec.model_dir,
                                                                   spec.hf_overrides))
        serve_steps(runtime, module, dtype)
    except Exception:
        logger.exception("worker rank %d failed", rank)
        sys.exit(1)
    finally:
        shutdown_runtime()
