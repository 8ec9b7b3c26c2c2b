"""`Engine.sleep` / `wake_up` (vLLM's sleep mode): the engine gives its device memory back
while it idles (an RL trainer takes the GPU between rollouts) and takes it again on waking.

While asleep the engine accepts requests but schedules none: they wait in the queue and run
after `wake_up`. After a level-2 sleep the weights hold no values until `update_weights` brings
them, and nothing is scheduled until then either (never an answer from empty weights).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ksana_llm.api.engine_thread import EngineThreadWork
from ksana_llm.runner.sleep_mode import check_sleep_level, check_wake_tags


class SleepControl(EngineThreadWork):
    """Mixed into `Engine`, which provides `config`, `model`, `_core`, `_on_engine_thread`,
    `_dispatch_step` and the queue's `_wake` and `_waiting_blocked`."""

    config: Any
    model: Any
    _wake: threading.Condition
    _waiting_blocked: bool

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (the prefix cache is emptied) and the weights' device memory:
        level 1 keeps the weights in host memory (on a CPU device they stay where they are),
        level 2 drops them (load them with `update_weights` after `wake_up`). Needs
        `enable_sleep_mode=True`; a ValueError while requests are running (wait for them or
        abort them): queued ones stay queued; a ValueError too while another running engine
        serves the same `Model` (its weights would vanish under it)."""
        level = check_sleep_level(level)
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True "
                             "(serve --enable-sleep-mode)")
        self.model.check_sole_engine(self, "sleep")

        def fall_asleep() -> None:
            self._dispatch_step(self._core.settle())
            scheduler = self._core.scheduler
            busy = len(scheduler.running) + len(scheduler.swapped)
            if busy:
                raise ValueError(f"sleep: {busy} requests are running; wait for them or abort "
                                 "them first")
            self._core.block_manager.reset_prefix_cache()
            self._core.runner.sleep(level)
            with self._wake:
                # Now rather than after the step loop's turn: a request submitted as soon as
                # sleep() returns must find no free slot about to take it (the queue limit).
                self._waiting_blocked = True

        self._on_engine_thread(fall_asleep)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Take the memory back: `tags` "weights" and/or "kv_cache" (default both), so that
        new weights can be loaded (`update_weights`) before the KV cache takes its memory."""
        chosen = check_wake_tags(tags)
        self._on_engine_thread(lambda: self._core.runner.wake_up(chosen))

    def is_sleeping(self) -> bool:
        """Whether requests wait instead of running: a part is asleep, or the weights a
        level-2 sleep dropped have not been loaded again."""
        return self._on_engine_thread(self._schedules_nothing)

    def _schedules_nothing(self) -> bool:
        runner = self._core.runner
        return bool(runner.asleep) or runner.weights_discarded
