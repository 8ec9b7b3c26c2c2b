"""What the load client records per request, and the figures and files it makes of them:
percentiles, the perf row (KsanaLLM's column names first), arrival times, the prompt CSV and the
output / perf CSVs (pure functions, unit-tested without a server)."""

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
    prompt: str  # the text, or "<N token ids>" for a prompt sent as token ids
    start: float = 0.0
    end: float = 0.0
    output: str = ""
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks with new tokens
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None
    prompt_is_text: bool = True  # False: `prompt` is a placeholder, not counted as input chars

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
              concurrency: int | None, percentiles: Sequence[float], stream: bool,
              passes: int = 1, decode_token_throughput: bool = False) -> dict[str, float]:
    """The perf row: KsanaLLM's columns first (same names), then our additions.

    `results` may pool `passes` runs of the workload (`--repeat_num_iters`) that took `duration`
    seconds together: "Total latency" is then one pass's average, as KsanaLLM reports it.
    Failed requests are counted but left out of every other figure. Token throughputs use the
    whole run's wall time, so they are what a user of the server would see. With
    `decode_token_throughput` (KsanaLLM's --show_decode_token_throughput) "Token throughput" counts
    only the tokens after each request's first; "Decode token throughput" always does.
    """
    ok = [r for r in results if r.ok]
    # A count the server did not report stays unknown (NaN average), rather than reading as 0.
    known_in = [r.input_tokens for r in ok if r.input_tokens is not None]
    known_out = [r.output_tokens for r in ok if r.output_tokens is not None]
    in_tokens, out_tokens = sum(known_in), sum(known_out)
    decode_tokens = sum(max(n - 1, 0) for n in known_out)
    latencies = [r.latency for r in ok]
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    row: dict[str, float] = {
        "Request rate": request_rate,
        "Concurrency": float(concurrency) if concurrency else math.inf,
        "Total latency": duration / max(passes, 1),
        "Request throughput": per_second(len(ok)),
        "Avg latency": mean(latencies),
        "Avg input chars": mean([len(r.prompt) for r in ok if r.prompt_is_text]),
        "Avg output chars": mean([len(r.output) for r in ok]),
        "Avg input tokens": mean(known_in),
        "Avg output tokens": mean(known_out),
        "Token throughput": per_second(decode_tokens if decode_token_throughput
                                       else in_tokens + out_tokens),
    }
    row.update({f"P{_fmt_p(p)} latency": percentile(latencies, p) for p in percentiles})
    if stream:
        row.update(_spread("TTFT", [r.ttft for r in ok if r.ttft is not None], percentiles))
        row.update(_spread("ITL", [gap for r in ok for gap in r.itls], percentiles))
        row.update(_spread("TPOT", [r.tpot for r in ok if r.tpot is not None], percentiles))
    row.update({
        "Input token throughput": per_second(in_tokens),
        "Output token throughput": per_second(out_tokens),
        "Decode token throughput": per_second(decode_tokens),
        "Median latency": percentile(latencies, 50),
        "Successful requests": float(len(ok)),
        "Failed requests": float(len(results) - len(ok)),
    })
    return row


def arrival_offsets(n: int, rate: float, rng: random.Random | None = None, *, burst: int = 1,
                    poisson: bool = False) -> list[float]:
    """Start times (seconds from t0) of n requests sent `burst` at a time (KsanaLLM's
    --concurrency), at `rate` requests/s on average: bursts evenly spaced `burst / rate` apart, or
    with `poisson` (KsanaLLM's --random) a Poisson process of bursts (exponential gaps of that
    mean, drawn from `rng`). An infinite rate sends everything at 0."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    burst = max(burst, 1)
    gap = burst / rate
    rng = rng or random.Random(0)
    starts, t = [], 0.0
    for _ in range((n + burst - 1) // burst):
        starts.append(t)
        t += rng.expovariate(1.0 / gap) if poisson else gap
    return [starts[i // burst] for i in range(n)]


def next_request_rate(history: Sequence[tuple[float, float, float]], *, start: float, step: float,
                      num_iters: int, max_avg_latency: float, max_first_token_latency: float,
                      max_rate: float) -> float | None:
    """The request rate of the next run, or None when done (KsanaLLM's sweep and SLA search).

    `history` holds (rate, avg latency, avg TTFT) of the runs so far. The first `num_iters` runs
    step the rate up from `start` by `step`. Then, if a latency bound is set, it searches the
    highest rate that keeps both averages within their bounds: double the highest rate while it
    passes (at most `max_rate`, the number of prompts), halve the lowest while it fails, else try
    the midpoint of the highest passing and the lowest failing rate; halves and midpoints are
    rounded to 0.1 req/s (at least 0.1). A rate already run ends the search.
    """
    if len(history) < num_iters:
        return start + step * len(history)
    if math.isinf(max_avg_latency) and math.isinf(max_first_token_latency):
        return None

    def passes(run: tuple[float, float, float]) -> bool:
        return run[1] <= max_avg_latency and run[2] <= max_first_token_latency

    def tenth(rate: float) -> float:
        return max(round(rate * 10) / 10, 0.1)

    runs = sorted(history)
    if passes(runs[-1]):
        rate = min(runs[-1][0] * 2, max_rate)
    elif not passes(runs[0]):
        rate = tenth(runs[0][0] / 2)
    else:
        best = max(r[0] for r in runs if passes(r))
        worst = min(r[0] for r in runs if not passes(r))
        rate = tenth((best + worst) / 2)
    return None if any(r[0] == rate for r in runs) else rate


# ---- input and output files --------------------------------------------------------------------

def read_prompts(path: str | Path, col_idx: int = 0, prompt_num: int = 0,
                 shuffle_rng: random.Random | None = None) -> list[str]:
    """Prompts from column `col_idx` of a CSV with a header row, shuffled by `shuffle_rng` if
    given (before `prompt_num` applies, as KsanaLLM does). `prompt_num` 0 = all; fewer takes the
    first ones; more cycles through them, so a small file can drive a long run."""
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
    if shuffle_rng is not None:
        shuffle_rng.shuffle(prompts)
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


def write_perf_csv(path: str | Path, rows: dict[str, float] | Sequence[dict[str, float]]) -> None:
    """A header and one row per run (one per request rate of a sweep), values `%.5f`."""
    rows = [rows] if isinstance(rows, dict) else list(rows)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(rows[0].keys())
        for row in rows:
            writer.writerow([f"{v:.5f}" for v in row.values()])


def format_summary(row: dict[str, float]) -> str:
    width = max(len(k) for k in row)
    return "\n".join(f"{k:<{width}} : {v:.5f}" for k, v in row.items())
