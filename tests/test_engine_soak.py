"""Everything at once, as a busy server meets it: requests arriving in waves while others run,
aborts, a KV pool too small for the load (preemption by swap or recompute), shared prompt
prefixes (prefix-cache hits), chunked prefill, parallel seeded samples, n-gram speculation and
priorities.

Whatever the engine interleaves, each greedy request must give transformers' greedy tokens on
the same weights, an aborted one a prefix of them, and two seeded sampled requests with the same
prompt and seed the same samples wherever they ran; at the end every KV block is free. The
other tests check each mechanism alone; this one checks them against each other.
"""

from __future__ import annotations

import random
import time

import pytest

import ksana_llm as kt
from ksana_llm.generation_config import GenerationConfig
from tests.family_harness import greedy_trace, hf_reference
from tests.parallel_models import build

pytestmark = pytest.mark.timeout(600)

NUM_REQUESTS = 36
WAVE = 6


def workload(seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_new_tokens) pairs; a third of the prompts extend an earlier one's first
    tokens, so their blocks can come from the prefix cache."""
    rng = random.Random(seed)
    items: list[tuple[list[int], int]] = []
    for index in range(NUM_REQUESTS):
        if index >= 3 and index % 3 == 0:
            base = items[rng.randrange(len(items))][0]
            prompt = base[:rng.randint(8, len(base))] + \
                [rng.randrange(3, 256) for _ in range(rng.randint(1, 12))]
        else:
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(4, 48))]
        items.append((prompt, rng.randint(6, 20)))
    return items


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("soak")
    hf = build("llama", folder)
    reference = hf_reference(hf)
    items = workload(seed=7)
    expected = [greedy_trace(reference, prompt, steps)[0][len(prompt):]
                for prompt, steps in items]
    return folder, items, expected


@pytest.mark.parametrize("settings", [
    {"preempt_mode": 0, "async_scheduling": True},
    {"preempt_mode": 1, "async_scheduling": False, "overlap_output_processing": True},
    {"preempt_mode": 0, "async_scheduling": False, "num_speculative_tokens": 3,
     "speculative_method": "ngram"},
    {"preempt_mode": 1, "scheduler_policy": "priority"},
], ids=["swap-async", "recompute-overlap", "swap-ngram", "recompute-priority"])
def test_a_mixed_load_keeps_every_answer(tiny, settings):
    folder, items, expected = tiny
    rng = random.Random(11)
    # Under the priority policy each request gets one of four priorities: urgent arrivals
    # preempt running requests of less urgent ones.
    priority = (lambda: rng.randrange(4)) if settings.get("scheduler_policy") == "priority" \
        else (lambda: 0)
    # 4-token blocks, 56 of them (224 tokens) against ~36 requests of up to 80 tokens arriving
    # six at a time: sequences must be preempted for others to run.
    engine = kt.Engine(str(folder), device="cpu", dtype="float32", block_token_num=4,
                       num_device_blocks=56, split_fuse_token_num=16, max_step_tokens=64,
                       max_num_seqs=8, **settings)
    greedy: dict[int, kt.RequestHandle] = {}
    # Each wave's seeded request, and its twin (same prompt and config) sent a wave later.
    firsts: list[kt.RequestHandle] = []
    twins: list[kt.RequestHandle] = []
    aborted: set[int] = set()
    try:
        for wave_start in range(0, NUM_REQUESTS, WAVE):
            for index in range(wave_start, min(wave_start + WAVE, NUM_REQUESTS)):
                prompt, steps = items[index]
                greedy[index] = engine.submit(kt.Request(prompt, GenerationConfig(
                    max_new_tokens=steps, ignore_eos=True), request_id=f"greedy-{index}",
                    priority=priority()))
            # A pair of seeded parallel-sampling requests per wave, the twin a wave later.
            prompt = items[wave_start][0]
            config = GenerationConfig(max_new_tokens=8, ignore_eos=True, do_sample=True,
                                      temperature=1.0, top_k=0, seed=wave_start,
                                      num_return_sequences=2)
            firsts.append(engine.submit(kt.Request(prompt, config, priority=priority())))
            if len(firsts) > 1:
                earlier = firsts[-2]
                twins.append(engine.submit(kt.Request(earlier.output.prompt_token_ids,
                                                      earlier.config, priority=priority())))
            # Abort one request of this wave while the load runs.
            victim = rng.randrange(wave_start, min(wave_start + WAVE, NUM_REQUESTS))
            time.sleep(rng.uniform(0.0, 0.05))
            engine.abort(f"greedy-{victim}")
            aborted.add(victim)
        outputs = {index: handle.result(timeout=300) for index, handle in greedy.items()}
        pairs = [(a.result(timeout=300), b.result(timeout=300)) for a, b in zip(firsts, twins)]
        for index, output in outputs.items():
            tokens = output.token_ids
            if index in aborted:
                assert tokens == expected[index][:len(tokens)], f"aborted request {index}"
            else:
                assert tokens == expected[index], f"request {index}"
        for first, twin in pairs:
            assert [s.token_ids for s in first.sequences] == \
                [s.token_ids for s in twin.sequences]
            assert len({tuple(s.token_ids) for s in first.sequences}) == 2
        stats = engine.stats()
        assert stats.num_preemptions > 0  # the pool really was too small
        assert stats.num_prefix_cache_hits > 0
        assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
        # Every block free once the cache lets go of the blocks it keeps for reuse.
        engine.reset_prefix_cache()
        assert engine.stats().num_free_kv_blocks == stats.num_kv_blocks
    finally:
        engine.shutdown()
