"""The offline benchmarks' workload and result records: random-id prompts and output lengths
drawn from a seed (no special tokens), and what each system did with them. Shared by
`benchmarks/offline_throughput.py` (CPU), `benchmarks/benchmark_throughput.py --random_workload`
(the same requests to a server) and `benchmarks/gpu/bench_engine.py`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ksana_llm.bench.workload import Workload, allowed_token_ids, build_workload

__all__ = ["LatencyResult", "ThroughputResult", "Workload", "allowed_token_ids", "batch1_prompt",
           "build_workload"]


# ---- records --------------------------------------------------------------------------------------
@dataclass
class ThroughputResult:
    name: str
    wall_s: float
    useful_tokens: int  # each request's own output length, summed
    raw_tokens: int  # everything the system generated (padding rows of static batches included)
    exact_lengths: bool  # every request got exactly its requested output length
    notes: str = ""
    token_ids: list[list[int]] = field(default_factory=list, repr=False)  # useful tokens per request
    same_as_ours: int | None = None  # requests whose greedy tokens equal ksana_llm's

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "token_ids"}
        return {**data, "tokens_per_s": self.tokens_per_s}


@dataclass
class LatencyResult:
    name: str
    ms_per_token: float  # median decode time per output token, first token excluded
    ttft_ms: float  # median time to first token
    samples_ms_per_token: list[float] = field(default_factory=list)


# ---- workload (built by the load client's module, so the server runs get the same requests) ----
def batch1_prompt(length: int, seed: int, allowed: np.ndarray) -> list[int]:
    return np.random.default_rng(seed + 1).choice(allowed, size=length).tolist()
