"""Counts of a per-step quantity in fixed buckets (the tokens each engine step computed, vLLM's
`iteration_tokens_total`), cheap enough for the step loop: one bisect and two additions a step.

Written by the engine thread only; a reader on another thread takes `snapshot()`, whose counts
are copied in one go (its `sum` may be a step behind them: a scrape between two additions)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["ITERATION_TOKEN_BUCKETS", "HistogramSnapshot", "StepHistogram"]

# vLLM's buckets for iteration_tokens_total when no CUDA-graph sizes are set, so its dashboards'
# queries (histogram_quantile over `le`) read ours unchanged.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class HistogramSnapshot:
    """`counts[i]`: observations in (buckets[i-1], buckets[i]]; the last entry counts those above
    every bound (Prometheus' +Inf bucket holds all of them: `count`)."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' bucket samples: (upper bound, observations at or below it), +Inf last."""
        out, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class StepHistogram:
    def __init__(self, buckets: tuple[float, ...] = ITERATION_TOKEN_BUCKETS) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be strictly increasing, got {buckets}")
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le = "<=").
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self._counts), self._sum)
