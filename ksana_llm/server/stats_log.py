"""The server's periodic stats line (vLLM's, on by default; `--disable-log-stats` turns it off):
every `--log-stats-interval` seconds while the engine has work, or did some since the last line,

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 8 reqs, Waiting: 0 reqs, Swapped: 0 reqs, KV cache usage: 12.5%,
    Prefix cache hit rate: 40.2%

and, with speculative decoding, what the interval's drafts gave (vLLM's SpecDecoding line):

    ..., Spec decoding: mean acceptance length 2.31, per-position acceptance rate 0.82, 0.49

on the `ksana_llm.stats` logger at INFO, which `serve` lets through whatever KLLM_LOG_LEVEL is,
so that an operator sees the server work without turning on every module's INFO lines.
An idle server says nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ksana_llm.api.stats import EngineStats

LOGGER_NAME = "ksana_llm.stats"
DEFAULT_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL


def stats_line(before: EngineStats, now: EngineStats, seconds: float) -> str | None:
    """The line for the `seconds` between two snapshots, or None when the engine was idle
    throughout (nothing computed, nothing running or waiting)."""
    prompt = (now.num_prompt_tokens - before.num_prompt_tokens) / seconds
    generation = (now.num_generation_tokens - before.num_generation_tokens) / seconds
    if not (prompt or generation or now.num_running or now.num_waiting or now.num_swapped):
        return None
    line = (f"Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: "
            f"{generation:.1f} tokens/s, Running: {now.num_running} reqs, Waiting: "
            f"{now.num_waiting} reqs, Swapped: {now.num_swapped} reqs, KV cache usage: "
            f"{100 * now.kv_cache_usage:.1f}%, Prefix cache hit rate: "
            f"{100 * now.prefix_cache_hit_rate:.1f}%")
    return line + _speculation(before, now)


def _speculation(before: EngineStats, now: EngineStats) -> str:
    """The interval's drafts: tokens gained per verifying step, and the share of verifying
    steps that accepted the draft at each position."""
    drafts = now.num_drafts - before.num_drafts
    if not drafts:
        return ""
    accepted = now.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    earlier = before.num_accepted_draft_tokens_per_position
    per_position = [count - (earlier[i] if i < len(earlier) else 0)
                    for i, count in enumerate(now.num_accepted_draft_tokens_per_position)]
    rates = ", ".join(f"{count / drafts:.2f}" for count in per_position) or "none accepted"
    return (f", Spec decoding: mean acceptance length {1 + accepted / drafts:.2f}, "
            f"per-position acceptance rate {rates}")


@dataclass
class StatsLogThread:
    """Logs `stats_line` every `interval_s` on a daemon thread until `stop()` or the engine
    stops running."""

    engine: Any  # an Engine: stats() and is_running
    interval_s: float = DEFAULT_INTERVAL_S

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"--log-stats-interval must be > 0 seconds, got {self.interval_s}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ksana-llm-stats", daemon=True)

    def start(self) -> StatsLogThread:
        logging.getLogger(LOGGER_NAME).setLevel(logging.INFO)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        logger = logging.getLogger(LOGGER_NAME)
        before, then = self.engine.stats(), time.monotonic()
        while not self._stop.wait(self.interval_s) and self.engine.is_running:
            now, at = self.engine.stats(), time.monotonic()
            line = stats_line(before, now, at - then)
            if line is not None:
                logger.info(line)
            before, then = now, at
