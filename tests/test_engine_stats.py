"""The Python API's statistics and memory sizing on the real default model: what `stats()`
reports, that its latency history keeps timings rather than outputs, and the host swap pool's
size (`swap_space`, `block_host_memory_factor`); the token counters and the periodic stats line
the server logs."""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from tests.engine_fixtures import engine_fixture

PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


engine = engine_fixture(generation_config=kt.GenerationConfig(max_new_tokens=16),
                        num_device_blocks=256)


def test_stats_report_queue_kv_and_latency(engine):
    engine.generate([PROMPT, "Hello"], use_tqdm=False)
    stats = engine.stats()
    assert stats.num_kv_blocks == 256 and 0.0 <= stats.kv_cache_usage <= 1.0
    assert stats.num_finished >= 2 and stats.ttft_p50_s is not None and stats.mean_latency_s > 0
    assert stats.generation_tokens_per_s > 0


def test_stats_keep_timings_not_outputs(model):
    """The latency statistics come from the finished requests' timings; the outputs themselves
    (tokens, text, logprobs: large) are not kept alive by them."""
    import gc
    import weakref

    def run(engine):  # (the outputs are referenced from this frame only)
        outs = engine.generate_outputs([PROMPT, "Hello"], kt.GenerationConfig(
            max_new_tokens=4, logprobs=5), use_tqdm=False)
        timings = [(o.metrics.ttft, o.metrics.latency) for o in outs]
        return [weakref.ref(o) for o in outs], timings

    with kt.Engine(model, num_device_blocks=64) as engine:
        refs, timings = run(engine)
        stats = engine.stats()
        assert stats.mean_latency_s == pytest.approx(sum(t[1] for t in timings) / 2, rel=1e-12)
        assert stats.ttft_p99_s == max(t[0] for t in timings)
        # (the step loop's locals may hold the last step's outputs until its next step)
        engine.generate("Hi", kt.GenerationConfig(max_new_tokens=1), use_tqdm=False)
        gc.collect()
        assert [ref() for ref in refs] == [None, None]


def test_swap_space_sizes_the_host_pool(model):
    """vLLM's swap_space (GiB) sizes the host swap pool instead of block_host_memory_factor
    (default: as many host blocks as device blocks); recompute mode keeps none."""
    from ksana_llm.runner.model_runner import kv_bytes_per_block

    per_block = kv_bytes_per_block(model.module, 16, torch.float32, 0)
    for kwargs, expected in (({}, 64), ({"block_host_memory_factor": 0.5}, 32),
                             ({"swap_space": 10 * per_block / 2**30}, 10),
                             ({"swap_space": 10 * per_block / 2**30, "preempt_mode": 1}, 0)):
        with kt.Engine(model, num_device_blocks=64, **kwargs) as engine:
            assert engine._core.block_manager.num_host_blocks == expected, kwargs
    with pytest.raises(ValueError, match="swap_space"):
        kt.Engine(model, num_device_blocks=64, swap_space=-1)


def test_token_counters_since_start(model):
    """`num_prompt_tokens` counts the prompt tokens the engine computed (prefix-cache hits
    not), `num_generation_tokens` every token generated: the periodic stats line's rates."""
    ids = model.tokenizer.encode(PROMPT * 3)
    config = kt.GenerationConfig(max_new_tokens=5, ignore_eos=True)
    with kt.Engine(model, num_device_blocks=64) as engine:
        first = engine.generate_outputs([ids], config, use_tqdm=False)[0]
        stats = engine.stats()
        assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (len(ids), 5)
        again = engine.generate_outputs([ids], config.replace(num_return_sequences=2, do_sample=True), use_tqdm=False)[0]
        stats = engine.stats()
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert stats.num_prompt_tokens == 2 * len(ids) - again.num_cached_tokens
    assert stats.num_generation_tokens == 5 + 2 * 5


def test_prompt_tokens_count_as_their_chunks_are_computed(model, monkeypatch):
    """Chunked prefill: the count grows by each step's chunk, not by the whole prompt when the
    request is admitted (the periodic stats line's prompt rate would show one spike, then
    nothing, while a long prompt is still being computed)."""
    ids = model.tokenizer.encode(PROMPT * 3)
    chunk = 16
    counts: list[int] = []
    with kt.Engine(model, num_device_blocks=64, split_fuse_token_num=chunk) as engine:
        core = engine._core
        step = core.step

        def counted_step(*args, **kwargs):
            out = step(*args, **kwargs)
            counts.append(core.stats().num_prompt_tokens)
            return out

        monkeypatch.setattr(core, "step", counted_step)
        engine.generate_outputs([ids], kt.GenerationConfig(max_new_tokens=2), use_tqdm=False)
    assert len(ids) > 3 * chunk
    grown = [b - a for a, b in zip([0, *counts], counts)]
    assert counts[-1] == len(ids) and max(grown) == chunk
    assert grown[:len(ids) // chunk] == [chunk] * (len(ids) // chunk)


def test_the_stats_line(engine):
    """vLLM's periodic line: rates over the interval between two snapshots; nothing when idle."""
    from dataclasses import replace

    from ksana_llm.server.stats_log import stats_line

    idle = engine.stats()
    assert idle.num_running == idle.num_waiting == 0
    assert stats_line(idle, idle, 10.0) is None
    busy = replace(idle, num_prompt_tokens=idle.num_prompt_tokens + 1000,
                   num_generation_tokens=idle.num_generation_tokens + 250, num_running=3,
                   kv_cache_usage=0.125, prefix_cache_hit_rate=0.5)
    assert stats_line(idle, busy, 10.0) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 25.0 tokens/s, "
        "Running: 3 reqs, Waiting: 0 reqs, Swapped: 0 reqs, KV cache usage: 12.5%, "
        "Prefix cache hit rate: 50.0%")
    # With speculative decoding: the interval's mean acceptance length and, per position, the
    # share of verifying steps that accepted that draft (counts since start, differenced).
    earlier = replace(idle, num_accepted_draft_tokens_per_position=(1,))
    drafted = replace(busy, num_drafts=idle.num_drafts + 30, num_accepted_draft_tokens=(
        idle.num_accepted_draft_tokens + 40), num_accepted_draft_tokens_per_position=(26, 15))
    assert stats_line(earlier, drafted, 10.0).endswith(
        ", Prefix cache hit rate: 50.0%, Spec decoding: mean acceptance length 2.33, "
        "per-position acceptance rate 0.83, 0.50")
    # The interval the last work ended in still gets its line; the idle ones after do not.
    assert stats_line(idle, replace(idle, num_generation_tokens=idle.num_generation_tokens + 4),
                      2.0).startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation "
                                      "throughput: 2.0 tokens/s, Running: 0 reqs")


def test_a_cuda_swap_pool_defaults_to_vllms_4_gib():
    """A CUDA swap pool is pinned at start: unset, it takes vLLM's 4 GiB, not a mirror of the
    device pool (an H200's ~130 GB would pin most of the host). Given settings still win, and
    half the free host RAM bounds all. Sizing only: no CUDA device is touched."""
    from ksana_llm.api.core_builder import CUDA_DEFAULT_SWAP_GIB, host_swap_blocks
    from ksana_llm.runner.memory import available_host_bytes

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    per_block = 2**20  # 1 MiB blocks
    default = kt.EngineConfig()
    assert default.block_host_memory_factor is None
    cap = available_host_bytes() // 2 // per_block
    assert host_swap_blocks(default, 70_000, per_block, cuda) \
        == min(int(CUDA_DEFAULT_SWAP_GIB * 1024), cap)
    assert host_swap_blocks(default, 100, per_block, cuda) == min(100, cap)  # a small pool
    assert host_swap_blocks(default, 700, per_block, cpu) == min(700, cap)  # mirrored
    factor = kt.EngineConfig(block_host_memory_factor=0.5)
    assert host_swap_blocks(factor, 700, per_block, cuda) == min(350, cap)
    space = kt.EngineConfig(swap_space=0.25)
    assert host_swap_blocks(space, 70_000, per_block, cuda) == min(256, cap)
    assert host_swap_blocks(kt.EngineConfig(preempt_mode=1), 700, per_block, cuda) == 0
