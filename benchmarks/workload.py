"""The offline benchmarks' workload and result records: random-id prompts and output lengths
drawn from a seed (no special tokens), and what each system did with them. Shared by
`benchmarks/offline_throughput.py` (CPU), `benchmarks/benchmark_throughput.py --random_workload`
(the same requests to a server) and `benchmarks/gpu/bench_engine.py`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


# ---- records --------------------------------------------------------------------------------------
@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def summary(self) -> dict[str, Any]:
        ins = [len(p) for p in self.prompts]
        return {"num_requests": len(self.prompts), "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "input_len_min": min(ins),
                "input_len_max": max(ins), "output_len_min": min(self.output_lens),
                "output_len_max": max(self.output_lens)}


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


# ---- workload -------------------------------------------------------------------------------------
def allowed_token_ids(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Vocabulary ids that are not special or added-special tokens."""
    size = vocab_size if tokenizer is None else min(vocab_size, len(tokenizer))
    special: set[int] = set()
    if tokenizer is not None:
        special.update(getattr(tokenizer, "all_special_ids", None) or [])
        for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(token, "special", False):
                special.add(int(token_id))
    ids = np.arange(size, dtype=np.int64)
    return ids[~np.isin(ids, np.fromiter(special, dtype=np.int64, count=len(special)))]


def build_workload(num_requests: int, min_len: int, max_len: int, seed: int,
                   allowed: np.ndarray) -> Workload:
    """Uniform input and output lengths in [min_len, max_len], random non-special token ids."""
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(min_len, max_len + 1, size=num_requests)
    output_lens = rng.integers(min_len, max_len + 1, size=num_requests)
    prompts = [rng.choice(allowed, size=int(n)).tolist() for n in input_lens]
    return Workload(prompts, [int(n) for n in output_lens])


def batch1_prompt(length: int, seed: int, allowed: np.ndarray) -> list[int]:
    return np.random.default_rng(seed + 1).choice(allowed, size=length).tolist()
