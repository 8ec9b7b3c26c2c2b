"""`Engine.embed` / `score` / `classify` and their coroutines (`embed_async`, ...) on the
default model: the coroutines give the blocking calls' results; a call finds the queue full of
other callers' requests and waits for room instead of failing; cancelling a coroutine aborts
what it queued. (Their numbers against transformers: tests/test_server_embeddings.py,
test_server_scores.py, test_sequence_classification.py.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

import ksana_llm as kt
from tests.engine_fixtures import engine_fixture, stats_once_blocks_free, wait_until_idle

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b\n", "A",
         "人工智能正在改变世界。", "Bananas are yellow.", "Gravity pulls."]

# One sequence slot and one queue place: a caller easily finds the queue full.
engine = engine_fixture(max_num_seqs=1, max_queue_size=1, num_device_blocks=64)


def test_coroutines_give_the_blocking_calls_results(engine):
    vectors = engine.embed(TEXTS)
    scores = engine.score(TEXTS[0], TEXTS[1:])

    async def both() -> tuple[torch.Tensor, list[float]]:
        return await asyncio.gather(engine.embed_async(TEXTS),
                                    engine.score_async(TEXTS[0], TEXTS[1:]))

    async_vectors, async_scores = asyncio.run(both())
    torch.testing.assert_close(async_vectors, vectors, atol=1e-5, rtol=1e-4)
    assert async_scores == pytest.approx(scores, abs=1e-5)
    with pytest.raises(ValueError, match="needs a sequence-classification model"):
        asyncio.run(engine.classify_async("a"))
    with pytest.raises(ValueError, match="^text_2"):
        asyncio.run(engine.score_async("a", []))


def test_a_queue_full_of_others_requests_is_waited_out(engine):
    """Another caller holds the slot and the queue place: embed (blocking or not) waits for
    room rather than failing (it used to raise IndexError: no request of its own to wait for)."""
    expected = engine.embed(TEXTS[:2])
    config = kt.GenerationConfig(max_new_tokens=12, ignore_eos=True)
    for call in ("blocking", "async"):
        running = engine.submit(kt.Request("Once upon a time", generation_config=config))
        while engine.stats().num_running == 0:
            pass
        waiting = engine.submit(kt.Request("Hello there", generation_config=config))
        if call == "blocking":
            vectors = engine.embed(TEXTS[:2])
        else:
            vectors = asyncio.run(engine.embed_async(TEXTS[:2]))
        torch.testing.assert_close(vectors, expected, atol=1e-5, rtol=1e-4)
        assert len(running.result().token_ids) == len(waiting.result().token_ids) == 12


def test_cancelling_a_coroutine_aborts_its_requests(engine):
    async def cancel_soon() -> None:
        task = asyncio.ensure_future(engine.embed_async(TEXTS * 4))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_soon())
    assert wait_until_idle(engine)
    stats = stats_once_blocks_free(engine)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert engine.embed(TEXTS[:1]).shape == (1, 576)  # and it goes on serving
