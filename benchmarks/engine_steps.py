"""Counting an engine's forward steps, for the benchmarks that report tokens per step."""

from __future__ import annotations

from typing import Any


def count_steps(engine: Any) -> dict[str, int]:
    """Wrap the engine core's `step` (a benchmark-only peek at the core); the returned dict's
    "steps" counts the calls from now on."""
    core, counter = engine._core, {"steps": 0}
    original = core.step

    def counting_step(*step_args: Any, **step_kwargs: Any) -> Any:
        counter["steps"] += 1
        return original(*step_args, **step_kwargs)

    core.step = counting_step
    return counter
