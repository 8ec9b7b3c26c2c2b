"""Random-token workloads: prompts of non-special token ids and per-request output lengths drawn
from a seed. `--random_workload` sends exactly the requests `benchmarks/offline_throughput.py`
runs offline (`benchmarks/workload.py` takes them from here), so server and offline throughput
compare on one workload; `--random_input_len` is KsanaLLM's fixed-length variant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


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


def fixed_length_prompts(num_requests: int, length: int, seed: int,
                         allowed: np.ndarray) -> list[list[int]]:
    """`num_requests` prompts of exactly `length` random non-special token ids."""
    rng = np.random.default_rng(seed)
    return [rng.choice(allowed, size=length).tolist() for _ in range(num_requests)]
