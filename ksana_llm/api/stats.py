"""Engine statistics: queue and KV state from the core, throughput and latency from recent history."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from ksana_llm.api.outputs import RequestOutput
from ksana_llm.engine.core import CoreStats
from ksana_llm.engine.step_histogram import HistogramSnapshot


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int  # queue length, including requests not yet picked up by the engine thread
    num_running: int
    num_swapped: int
    kv_cache_usage: float  # share of device KV blocks held by live sequences
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int
    prefix_cache_hit_rate: float
    num_finished: int
    generation_tokens_per_s: float  # over the last `window_s` seconds
    mean_latency_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    peak_used_kv_blocks: int = 0  # most device KV blocks held at once since the engine started
    # Speculative decoding, since the engine started: drafts verified, and those accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # ... how many times a sequence's drafts were verified, and how many of those accepted the
    # draft at each position (0 = the first; vLLM's per-position counters): where acceptance
    # falls off says how many drafts are worth proposing.
    num_drafts: int = 0
    num_accepted_draft_tokens_per_position: tuple[int, ...] = ()
    # Prefill/decode disaggregation, since the engine started: prompt tokens whose KV was
    # imported from (exported to) another engine.
    num_imported_kv_tokens: int = 0
    num_exported_kv_tokens: int = 0
    # LoRA: the adapter slots, the names of the adapters running and waiting requests use, and
    # how many times an adapter was copied into a slot (more adapters than slots take turns).
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    num_lora_slot_loads: int = 0
    # Since the engine started: prompt tokens it computed (prefix-cache hits and imported KV
    # not), and tokens it generated (throughput over any interval: the difference of two).
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Since the engine started: prompt tokens looked up in the prefix cache, and those found
    # (vLLM's prefix_cache_queries / prefix_cache_hits; their ratio is prefix_cache_hit_rate).
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    # Since the engine started: how many tokens each step computed (prompt chunks, decode
    # tokens and drafts of every scheduled sequence), in ITERATION_TOKEN_BUCKETS.
    iteration_tokens: HistogramSnapshot | None = None

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / verified drafts (None before any draft)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_draft_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a sequence gains per verifying step: 1 (the verifier's own) + its accepted
        drafts, on average (vLLM's "mean acceptance length"; None before any draft)."""
        if not self.num_drafts:
            return None
        return 1 + self.num_accepted_draft_tokens / self.num_drafts

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (the iteration histogram as its buckets, counts and sum)."""
        iteration = self.iteration_tokens
        return {**self.__dict__, "draft_acceptance_rate": self.draft_acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "iteration_tokens": None if iteration is None else asdict(iteration)}


class StatsTracker:
    """Written by the engine thread, read by anyone (a lock guards the deques)."""

    def __init__(self, window_s: float = 10.0, history: int = 1000) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._token_events: deque[tuple[float, int]] = deque()
        # (ttft, latency) of the last `history` finished requests: their timings only, not the
        # outputs, which can be large (tokens, text, logprobs) and would be kept alive with them.
        self._finished: deque[tuple[float | None, float | None]] = deque(maxlen=history)
        self._num_finished = 0
        self._num_generated = 0

    def record_outputs(self, outputs: list) -> None:
        tokens = sum(len(o.new_token_ids) for o in outputs)
        if not tokens:
            return  # (the step loop reports twice a step, often with nothing)
        now = time.monotonic()
        with self._lock:
            self._num_generated += tokens
            self._token_events.append((now, tokens))
            while self._token_events and self._token_events[0][0] < now - self.window_s:
                self._token_events.popleft()

    def record_finished(self, output: RequestOutput) -> None:
        timings = (output.metrics.ttft, output.metrics.latency)
        with self._lock:
            self._finished.append(timings)
            self._num_finished += 1

    def snapshot(self, core: CoreStats, num_inbox: int = 0, *, max_loras: int = 0,
                 lora_names: dict[int, str] | None = None) -> EngineStats:
        """`lora_names`: adapter id -> name, for the adapters in use."""
        now = time.monotonic()
        with self._lock:
            events = [(t, n) for t, n in self._token_events if t >= now - self.window_s]
            finished = list(self._finished)
            num_finished = self._num_finished
            num_generated = self._num_generated
        span = (now - events[0][0]) if events else 0.0
        tokens = sum(n for _, n in events)
        ttfts = [ttft for ttft, _ in finished if ttft is not None]
        latencies = [latency for _, latency in finished if latency is not None]
        hit_rate = core.prefix_cache_hits / core.prefix_cache_queries if core.prefix_cache_queries else 0.0
        return EngineStats(
            num_waiting=core.num_waiting + num_inbox, num_running=core.num_running,
            num_swapped=core.num_swapped, kv_cache_usage=core.kv_cache_usage,
            num_kv_blocks=core.num_blocks, num_free_kv_blocks=core.num_free_blocks,
            peak_used_kv_blocks=core.peak_used_blocks,
            num_draft_tokens=core.num_draft_tokens,
            num_accepted_draft_tokens=core.num_accepted_draft_tokens,
            num_drafts=core.num_drafts,
            num_accepted_draft_tokens_per_position=core.num_accepted_per_position,
            num_imported_kv_tokens=core.num_imported_kv_tokens,
            num_exported_kv_tokens=core.num_exported_kv_tokens,
            num_preemptions=core.num_preemptions, prefix_cache_hit_rate=hit_rate,
            num_finished=num_finished,
            generation_tokens_per_s=tokens / span if span > 0 else 0.0,
            mean_latency_s=sum(latencies) / len(latencies) if latencies else None,
            ttft_p50_s=_percentile(ttfts, 50), ttft_p90_s=_percentile(ttfts, 90),
            ttft_p99_s=_percentile(ttfts, 99), max_loras=max_loras,
            running_lora_adapters=_names(core.running_lora_ids, lora_names),
            waiting_lora_adapters=_names(core.waiting_lora_ids, lora_names),
            num_lora_slot_loads=core.num_lora_loads, num_prompt_tokens=core.num_prompt_tokens,
            num_generation_tokens=num_generated,
            num_prefix_cache_queries=core.prefix_cache_queries,
            num_prefix_cache_hits=core.prefix_cache_hits,
            iteration_tokens=core.iteration_tokens)


def _names(lora_ids: tuple[int, ...], names: dict[int, str] | None) -> tuple[str, ...]:
    # Each name once: an unloaded adapter still held by requests keeps its name, which a newer
    # adapter may have taken. (One freed while a stats call ran has no name: left out.)
    return tuple(sorted({names[i] for i in lora_ids if names and i in names}))
