"""The cyclic garbage collector's passes during a measured run: how many, how long.

A full pass stalls every Python thread, the engine's step loop included, for as long as it
walks the heap (`ksana_llm/runner/gc_heap.py`); per-step medians hide such pauses, so the
benchmarks report them apart.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Records every collector pass while inside `with GcPauses() as pauses:`."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._start = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def summary(self) -> dict[str, float]:
        """passes, full_passes (oldest generation), total_ms, full_ms, longest_ms."""
        full = [t for g, t in self.pauses if g == 2]
        return {"passes": len(self.pauses), "full_passes": len(full),
                "total_ms": round(1e3 * sum(t for _, t in self.pauses), 1),
                "full_ms": round(1e3 * sum(full), 1),
                "longest_ms": round(1e3 * max((t for _, t in self.pauses), default=0.0), 1)}

    def describe(self) -> str:
        s = self.summary()
        return (f"{s['passes']} passes, {s['total_ms']:.1f} ms ({s['full_passes']} full: "
                f"{s['full_ms']:.1f} ms), longest {s['longest_ms']:.1f} ms")
