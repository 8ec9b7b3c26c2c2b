"""Parallel sampling (num_return_sequences = n, best_of) on the real default model.

One request's n samples are prefilled once and share the prompt's KV blocks; sample i of a seeded
request draws from seed + i, so it must equal a single request with that seed -- which is how the
samples are checked, alone, inside a busy batch and under preemption.
"""

from __future__ import annotations

import pytest

import ksana_llm as kt
from tests.engine_fixtures import stats_once_blocks_free

SEED = 11
PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type "
          "changed how books were made. Tell me a short story about it:")


def _sampling(**kwargs) -> kt.GenerationConfig:
    kwargs.setdefault("max_new_tokens", 10)
    return kt.GenerationConfig(do_sample=True, temperature=1.0, top_p=0.95, ignore_eos=True,
                               seed=SEED, **kwargs)


@pytest.fixture(scope="module")
def singles(default_model):
    """Eight single requests with seeds SEED .. SEED + 7 (what the samples must equal)."""
    with kt.Engine(default_model, num_device_blocks=256) as engine:
        return engine.generate_outputs([PROMPT] * 8, [_sampling().replace(seed=SEED + i)
                                                      for i in range(8)], use_tqdm=False)


def test_n_samples_equal_single_requests_and_use_fewer_blocks(default_model):
    ids = default_model.tokenizer.encode(PROMPT)
    assert len(ids) % 4 != 0  # the last prompt block is partial: it is copied on write
    kwargs = dict(num_device_blocks=128, block_token_num=4, enable_prefix_caching=False)
    with kt.Engine(default_model, **kwargs) as engine:
        separate = engine.generate_outputs([ids] * 8, [_sampling().replace(seed=SEED + i)
                                                       for i in range(8)], use_tqdm=False)
        peak_separate = engine.stats().peak_used_kv_blocks
    with kt.Engine(default_model, **kwargs) as engine:
        out = engine.generate_outputs(ids, _sampling(num_return_sequences=8), use_tqdm=False)[0]
        peak_forked = engine.stats().peak_used_kv_blocks
        assert engine.stats().num_free_kv_blocks == 128
    assert [s.token_ids for s in out.sequences] == [o.token_ids for o in separate]
    assert [s.text for s in out.sequences] == [o.text for o in separate]
    assert len({s.text for s in out.sequences}) > 1  # they really are different samples
    assert out.text == out.sequences[0].text and out.token_ids == out.sequences[0].token_ids
    assert all(s.finish_reason == "length" for s in out.sequences)
    per_request = -(-(len(ids) + 10) // 4)
    assert peak_separate == 8 * per_request
    # One prompt's full blocks, then each sample's own tail (its copy of the partial block on).
    prompt_full = len(ids) // 4
    assert peak_forked == prompt_full + 8 * (per_request - prompt_full) < peak_separate


def test_seeded_requests_are_identical_alone_and_inside_a_busy_batch(default_model, singles):
    long_prompt = "Summarize: " + "The quick brown fox jumps over the lazy dog. " * 30
    busy = [
        (PROMPT, _sampling(num_return_sequences=4)),
        ("Hello there!", kt.GenerationConfig(max_new_tokens=12)),  # greedy
        ("Write a poem.", kt.GenerationConfig(max_new_tokens=12, do_sample=True)),  # unseeded
        (long_prompt, kt.GenerationConfig(max_new_tokens=6, do_sample=True, top_k=20,
                                          presence_penalty=0.5)),
        ("Count: one, two,", kt.GenerationConfig(max_new_tokens=8, num_beams=2)),
        (PROMPT, _sampling().replace(seed=SEED + 5, logprobs=1)),  # a seeded single request
        ("Name a fruit.", kt.GenerationConfig(max_new_tokens=12, do_sample=True,
                                              num_return_sequences=3, best_of=4)),
    ]
    # A small token budget: prefills are chunked and share steps with the others' decodes.
    with kt.Engine(default_model, num_device_blocks=256, max_batch_size=64) as engine:
        outs = engine.generate_outputs([p for p, _ in busy], [c for _, c in busy], use_tqdm=False)
        assert engine.stats().num_free_kv_blocks == 256
    assert [s.text for s in outs[0].sequences] == [o.text for o in singles[:4]]
    assert outs[5].text == singles[5].text
    assert len(outs[5].logprobs) == 10
    assert len(outs[6].sequences) == 3 and len(outs[4].sequences) == 1


def test_best_of_keeps_the_samples_with_the_highest_cumulative_logprob(default_model):
    with kt.Engine(default_model, num_device_blocks=256) as engine:
        pool = engine.generate_outputs(PROMPT, _sampling(num_return_sequences=6, logprobs=0),
                                       use_tqdm=False)[0]
        best = engine.generate_outputs(PROMPT, _sampling(num_return_sequences=2, best_of=6),
                                       use_tqdm=False)[0]
    for s in pool.sequences:
        assert s.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in s.logprobs), abs=1e-4)
    ranked = sorted(pool.sequences, key=lambda s: -s.cumulative_logprob)[:2]
    assert [s.token_ids for s in best.sequences] == [s.token_ids for s in ranked]
    assert [s.text for s in best.sequences] == [s.text for s in ranked]
    assert [s.cumulative_logprob for s in best.sequences] == pytest.approx(
        [s.cumulative_logprob for s in ranked], abs=1e-4)
    assert best.text == ranked[0].text


@pytest.mark.parametrize("preempt_mode", [0, 1], ids=["swap", "recompute"])
def test_forked_samples_survive_preemption(default_model, singles, preempt_mode):
    # 14 blocks of 8 tokens: two 4-sample requests plus three others outgrow the pool.
    others = ["Hi!", "What is 2 + 2?", "Name three rivers."]
    with kt.Engine(default_model, num_device_blocks=14, block_token_num=8,
                   preempt_mode=preempt_mode) as engine:
        outs = engine.generate_outputs(
            [PROMPT, *others, PROMPT],
            [_sampling(num_return_sequences=4)] + [kt.GenerationConfig(max_new_tokens=10)] * 3
            + [_sampling(num_return_sequences=4).replace(seed=SEED + 4)], use_tqdm=False)
        stats = engine.stats()
        assert stats.num_preemptions > 0
        assert stats.num_free_kv_blocks == 14 and stats.num_swapped == 0
    assert [s.text for s in outs[0].sequences] == [o.text for o in singles[:4]]
    assert [s.text for s in outs[4].sequences] == [o.text for o in singles[4:8]]


def test_streamed_deltas_carry_sequence_indices(local_engine):
    handle = local_engine.submit(kt.Request(PROMPT, _sampling(num_return_sequences=3)))
    texts, finished = ["", "", ""], [0, 0, 0]
    for delta in handle.deltas():
        texts[delta.index] += delta.text
        finished[delta.index] += delta.finish_reason is not None
    out = handle.output
    assert texts == [s.text for s in out.sequences] and finished == [1, 1, 1]
    # Plain iteration streams sequence 0, the top-level text.
    again = local_engine.submit(kt.Request(PROMPT, _sampling(num_return_sequences=3)))
    assert "".join(again) == out.text == again.output.text
    # best_of ranks at the end: each returned sequence arrives whole, best first.
    ranked = local_engine.submit(kt.Request(PROMPT, _sampling(num_return_sequences=2, best_of=3)))
    deltas = list(ranked.deltas())
    assert [d.index for d in deltas] == [0, 1]
    assert [d.text for d in deltas] == [s.text for s in ranked.output.sequences]


def test_abort_frees_every_forked_block(local_engine):
    config = _sampling(num_return_sequences=4, max_new_tokens=500)
    handle = local_engine.submit(kt.Request(PROMPT, config))
    next(iter(handle))  # the samples have forked and are decoding
    local_engine.abort(handle.id)
    out = handle.result(timeout=60)
    assert out.finished and [s.finish_reason for s in out.sequences] == ["abort"] * 4
    stats = stats_once_blocks_free(local_engine)
    assert stats.num_free_kv_blocks == 256 and stats.num_running == 0


@pytest.mark.parametrize("wide", [_sampling(num_return_sequences=3),
                                  kt.GenerationConfig(max_new_tokens=8, num_beams=3,
                                                      num_return_sequences=3)],
                         ids=["samples", "beams"])
def test_forks_stay_within_max_num_seqs(default_model, wide):
    """A request of 3 samples or beams reserves 3 slots before it forks: three single requests
    once filled those slots, and a step then ran 6 sequences at max_num_seqs 4 (past the size
    the KV cache was profiled for on CUDA, and past the captured graphs)."""
    with kt.Engine(default_model, num_device_blocks=256, max_num_seqs=4) as engine:
        scheduler, widest = engine._core.scheduler, []
        schedule = scheduler.schedule

        def counting_schedule():
            out = schedule()
            widest.append(max(len(out.scheduled), len(scheduler.running)))
            return out

        scheduler.schedule = counting_schedule
        single = kt.GenerationConfig(max_new_tokens=8, ignore_eos=True)
        outs = engine.generate_outputs([PROMPT, "Hello there", "One two three", "Paris is"],
                                       [wide, single, single, single], use_tqdm=False)
    assert [len(o.sequences) for o in outs] == [3, 1, 1, 1]
    assert max(widest) == 4
