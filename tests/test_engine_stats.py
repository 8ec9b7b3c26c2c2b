"""The Python API's statistics and memory sizing on the real default model: what `stats()`
reports, that its latency history keeps timings rather than outputs, and the host swap pool's
size (`swap_space`, `block_host_memory_factor`)."""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt

PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


@pytest.fixture(scope="module")
def model(default_model):
    return default_model


@pytest.fixture(scope="module")
def engine(model):
    with kt.Engine(model, generation_config=kt.GenerationConfig(max_new_tokens=16),
                   num_device_blocks=256) as engine:
        yield engine


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
