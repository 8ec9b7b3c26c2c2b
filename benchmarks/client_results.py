"""What the load client records per request, and the figures and files it makes of them:
percentiles, the perf row (KsanaLLM's column names first), Poisson arrivals, the prompt CSV
and the output / perf CSVs (pure functions, unit-tested without a server)."""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


# ---- per-request record ------------------------------------------------------------------------

@dataclass
class RequestResult:
    """What one request did. Times are `time.perf_counter()` seconds."""

    index: int
    prompt: str
    start: float = 0.0
    end: float = 0.0
    output: str = ""
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks with new tokens
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# ---- statistics (pure) -------------------------------------------------------------------------

def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _fmt_p(p: float) -> str:
    return f"{p:g}"


def _spread(name: str, values: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    row = {f"Avg {name}": mean(values), f"Median {name}": percentile(values, 50)}
    row.update({f"P{_fmt_p(p)} {name}": percentile(values, p) for p in percentiles})
    return row


def summarize(results: Sequence[RequestResult], duration: float, *, request_rate: float,
              concurrency: int | None, percentiles: Sequence[float], stream: bool
              ) -> dict[str, float]:
    """The perf row: KsanaLLM's columns first (same names), then our additions.

    Failed requests are counted but left out of every other figure. Token throughputs use the
    whole run's wall time, so they are what a user of the server would see.
    """
    ok = [r for r in results if r.ok]
    # A count the server did not report stays unknown (NaN average), rather than reading as 0.
    known_in = [r.input_tokens for r in ok if r.input_tokens is not None]
    known_out = [r.output_tokens for r in ok if r.output_tokens is not None]
    in_tokens, out_tokens = sum(known_in), sum(known_out)
    latencies = [r.latency for r in ok]
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    row: dict[str, float] = {
        "Request rate": request_rate,
        "Concurrency": float(concurrency) if concurrency else math.inf,
        "Total latency": duration,
        "Request throughput": per_second(len(ok)),
        "Avg latency": mean(latencies),
        "Avg input chars": mean([len(r.prompt) for r in ok]),
        "Avg output chars": mean([len(r.output) for r in ok]),
        "Avg input tokens": mean(known_in),
        "Avg output tokens": mean(known_out),
        "Token throughput": per_second(in_tokens + out_tokens),
    }
    row.update({f"P{_fmt_p(p)} latency": percentile(latencies, p) for p in percentiles})
    if stream:
        row.update(_spread("TTFT", [r.ttft for r in ok if r.ttft is not None], percentiles))
        row.update(_spread("ITL", [gap for r in ok for gap in r.itls], percentiles))
        row.update(_spread("TPOT", [r.tpot for r in ok if r.tpot is not None], percentiles))
    row.update({
        "Input token throughput": per_second(in_tokens),
        "Output token throughput": per_second(out_tokens),
        "Median latency": percentile(latencies, 50),
        "Successful requests": float(len(ok)),
        "Failed requests": float(len(results) - len(ok)),
    })
    return row


def arrival_offsets(n: int, rate: float, rng: random.Random) -> list[float]:
    """Start times (seconds from t0) of n requests: a Poisson process of `rate` req/s, or all at
    0 when the rate is infinite. Exponential gaps are what a Poisson process has."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


# ---- input and output files --------------------------------------------------------------------

def read_prompts(path: str | Path, col_idx: int = 0, prompt_num: int = 0) -> list[str]:
    """Prompts from column `col_idx` of a CSV with a header row. `prompt_num` 0 = all; more than
    the file holds cycles through it, so a small file can drive a long run."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))[1:]
    prompts = []
    for line, row in enumerate(rows, start=2):
        if col_idx >= len(row):
            raise ValueError(f"{path}:{line}: no column {col_idx} (the row has {len(row)})")
        if row[col_idx].strip():
            prompts.append(row[col_idx])
    if not prompts:
        raise ValueError(f"{path}: no prompts in column {col_idx}")
    if prompt_num > 0:
        prompts = [prompts[i % len(prompts)] for i in range(prompt_num)]
    return prompts


OUTPUT_COLUMNS = ("index", "output", "prompt", "input_tokens", "output_tokens", "latency_s",
                  "ttft_s", "error")


def write_output_csv(path: str | Path, results: Sequence[RequestResult]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(OUTPUT_COLUMNS)
        for r in sorted(results, key=lambda r: r.index):
            writer.writerow([r.index, r.output, r.prompt, r.input_tokens, r.output_tokens,
                             f"{r.latency:.5f}", "" if r.ttft is None else f"{r.ttft:.5f}",
                             r.error or ""])


def write_perf_csv(path: str | Path, row: dict[str, float]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(row.keys())
        writer.writerow([f"{v:.5f}" for v in row.values()])


def format_summary(row: dict[str, float]) -> str:
    width = max(len(k) for k in row)
    return "\n".join(f"{k:<{width}} : {v:.5f}" for k, v in row.items())
