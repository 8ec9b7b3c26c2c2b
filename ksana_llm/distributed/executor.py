"""Rank 0's side of a parallel run: its own runner plus the worker ranks it drives.

`DistributedRunner` has the `ModelRunner` interface the engine core uses (`execute`, `device`):
each step goes to every worker first, then rank 0 runs its own share of the forward; the
collectives inside the forward keep the ranks in lockstep. A worker that dies makes the next step
fail with a clear error (a local worker is also watched between steps), never a hang.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ksana_llm.distributed.runtime import (Runtime, broadcast_message, gather_messages,
                                           shutdown_runtime)
from ksana_llm.distributed.worker import (DRAFT, LORA, LORA_READY, RUNNER, SLEEP, STEP, STOP,
                                         WAKE_UP, WEIGHTS, WEIGHTS_COMMIT, lora_error,
                                         refusal)
from ksana_llm.models.weight_update import WeightUpdate
from ksana_llm.runner.drafting import DraftInput
from ksana_llm.runner.model_runner import ModelRunner, StepInput, StepResult

logger = logging.getLogger("ksana_llm.distributed")

# How long the workers have, together, to finish their last step and exit after STOP.
_STOP_TIMEOUT_S = 30.0


class WorkerFailure(RuntimeError):
    """A worker rank died or its connection broke: the engine cannot go on."""


class DistributedRunner:
    def __init__(self, runner: ModelRunner, runtime: Runtime, runner_kwargs: dict[str, Any],
                 workers: list[Any] = (), on_failure: Callable[[str], None] | None = None) -> None:
        self.local = runner
        self.runtime = runtime
        self.workers = list(workers)  # local worker processes (multiprocessing.Process)
        self._on_failure = on_failure
        self.failure: str | None = None
        self._closed = False
        broadcast_message((RUNNER, runner_kwargs), runtime)
        if self.workers:
            threading.Thread(target=self._watch_workers, name="ksana-llm-worker-watch",
                             daemon=True).start()

    @property
    def device(self) -> torch.device:
        return self.local.device

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            logger.error(message)
            if self._on_failure is not None:
                self._on_failure(message)

    def _watch_workers(self) -> None:
        sentinels = {w.sentinel: w for w in self.workers}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closed:
            return
        dead = sentinels[ready[0]]
        dead.join(timeout=1)
        self._fail(f"worker process {dead.name} exited with code {dead.exitcode}; "
                   "the engine cannot continue without it")

    def execute(self, step: StepInput) -> StepResult:
        return self._everywhere(STEP, step, self.local.execute)

    def propose(self, draft: DraftInput) -> torch.Tensor:
        """Speculative decoding's draft layer runs on every rank too (it is split like the rest)."""
        return self._everywhere(DRAFT, draft, self.local.propose)

    def register_lora(self, lora_id: int, path: str) -> None:
        """Every rank reads the adapter and keeps its slices. Rank 0 checks its own part first;
        a worker that refuses its part (a module only another pipeline stage has, a folder
        missing on its node) says why, and the adapter is unregistered on every rank: a
        ValueError, and no rank holds an adapter the others lack. Steps then copy it into
        slots on every rank alike (`StepInput.lora_loads`)."""
        self.local.register_lora(lora_id, path)
        errors = [e for e in self._lora_everywhere(lora_id, path) if e is not None]
        if errors:
            self._lora_everywhere(lora_id, None)
            raise ValueError(errors[0])

    def unregister_lora(self, lora_id: int) -> None:
        self._lora_everywhere(lora_id, None)

    def prepare_lora(self, lora_id: int) -> None:
        """Every rank makes sure it has adapter `lora_id`'s host copy for the next step (read
        again if max_cpu_loras dropped it; each rank answers for its own copies). A rank that
        cannot is a ValueError: the step leaves the adapter out on every rank."""
        slots = self.local.lora
        if slots is None or slots.max_host_copies is None:
            return  # every copy is kept: nothing to read again, no round trip to the workers

        def here(_: object) -> list[str | None]:
            return gather_messages(lora_error(self.local, lora_id, None, ready=True),
                                   self.runtime)

        errors = [e for e in self._everywhere(LORA_READY, lora_id, here) if e is not None]
        if errors:
            raise ValueError(errors[0])

    def stage_weights(self, update: WeightUpdate) -> int:
        """Every rank checks the update against its own slices and keeps it; a rank's refusal is
        a ValueError and every rank drops it, so no rank changes a value the others keep.
        Tensors travel to the workers on the host."""
        if update.tensors:
            update = WeightUpdate(tensors=tuple((name, tensor.cpu())
                                                for name, tensor in update.tensors))
        count = [0]

        def stage(staged: WeightUpdate) -> None:
            count[0] = self.local.stage_weights(staged)

        try:
            self._on_every_rank(WEIGHTS, update, stage)
        except ValueError:
            self.commit_weights(False)
            raise
        return count[0]

    def commit_weights(self, apply: bool) -> None:
        """Every rank applies its staged update (or drops it). A rank that fails here has
        changed some weights already: a RuntimeError, the model's weights are mixed."""
        try:
            self._on_every_rank(WEIGHTS_COMMIT, apply, self.local.commit_weights)
        except ValueError as exc:
            raise RuntimeError(f"a rank failed to apply the weight update: {exc}") from exc

    @property
    def asleep(self) -> tuple[str, ...]:
        return self.local.asleep

    @property
    def weights_discarded(self) -> bool:
        return self.local.weights_discarded

    def sleep(self, level: int) -> None:
        """Every rank frees its memory (sleep mode, `runner.sleep_mode`)."""
        self._on_every_rank(SLEEP, level, self.local.sleep)

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        self._on_every_rank(WAKE_UP, tags, self.local.wake_up)

    def _on_every_rank(self, kind: str, payload: Any, work: Callable[[Any], Any]) -> None:
        """`work(payload)` here and the message on every worker; the first refusal a rank
        answers with (ValueError), after every rank has answered."""
        def here(value: Any) -> list[str | None]:
            return gather_messages(refusal(work, value), self.runtime)

        errors = [e for e in self._everywhere(kind, payload, here) if e is not None]
        if errors:
            raise ValueError(errors[0])

    def _lora_everywhere(self, lora_id: int, path: str | None) -> list[str | None]:
        """The LORA message to the workers (rank 0 unregisters its own copy for path None);
        each rank's refusal or None."""
        def here(_: object) -> list[str | None]:
            mine = lora_error(self.local, lora_id, None) if path is None else None
            return gather_messages(mine, self.runtime)

        return self._everywhere(LORA, (lora_id, path), here)

    def _everywhere(self, kind: str, payload: Any, run: Callable[[Any], Any]) -> Any:
        if self.failure is not None:
            raise WorkerFailure(self.failure)
        try:
            broadcast_message((kind, payload), self.runtime)
            return run(payload)
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection
            self._fail(f"a worker rank failed during a step: {exc}")
            raise WorkerFailure(self.failure) from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            try:
                broadcast_message((STOP, None), self.runtime)
            except RuntimeError:
                logger.warning("could not tell the workers to stop", exc_info=True)
        if self.failure is not None:
            # A rank died: the others wait in a collective that can never complete, and would
            # only give up at its timeout. Stop them now (a supervisor restarts the server).
            for worker in self.workers:
                if worker.is_alive():
                    worker.terminate()
        deadline = time.monotonic() + _STOP_TIMEOUT_S  # for all of them, not each in turn
        for worker in self.workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=5)
        shutdown_runtime()
