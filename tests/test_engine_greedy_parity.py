"""Greedy output of the real default model (SmolLM2-135M-Instruct) through our engine equals
transformers' greedy output token for token: alone, batched, chunked, with prefix-cache hits (and
through a reset of the cache) and under forced preemption in both modes."""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from tests.hf_references import hf_greedy_tokens

MAX_NEW = 24

CHAT = [
    "What is the capital of France?",
    "请用一句话介绍一下长城。",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three primary colors.",
    "Translate to French: The weather is nice today.",
]
RAW = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "The quick brown fox jumps over the lazy dog. Once upon a time,",
]


def _long_prompt(tokenizer) -> str:
    text = ("The history of the printing press begins in the fifteenth century, when movable "
            "type changed how books were made across Europe. ") * 60
    prompt = text + "\nSummarize the text above in one sentence."
    assert len(tokenizer.encode(prompt)) > 1000
    return prompt


@pytest.fixture(scope="module")
def prompts(model):
    tok = model.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                    tokenize=False) for c in CHAT]
    return chat + RAW + [_long_prompt(tok)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    """transformers' greedy tokens for each prompt (same weights, fp32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    return hf_greedy_tokens(hf, model.tokenizer, prompts, MAX_NEW)


def _engine(model, **kwargs) -> kt.Engine:
    kwargs.setdefault("num_device_blocks", 512)
    return kt.Engine(model, generation_config=kt.GenerationConfig(max_new_tokens=MAX_NEW), **kwargs)


def _assert_same(outputs, reference):
    assert len(outputs) == len(reference)
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.token_ids == ref, f"prompt {i}: ours {out.token_ids} != transformers {ref}"


def test_prompt_set_is_varied(prompts, model):
    assert len(prompts) >= 8
    assert max(len(model.tokenizer.encode(p)) for p in prompts) > 1000


def test_each_prompt_alone(model, prompts, reference):
    with _engine(model) as engine:
        outs = [engine.generate_outputs(p, use_tqdm=False)[0] for p in prompts]
    _assert_same(outs, reference)


def test_all_prompts_in_one_batch(model, prompts, reference):
    with _engine(model) as engine:
        outs = engine.generate_outputs(prompts, use_tqdm=False)
    _assert_same(outs, reference)


def test_chunked_prefill(model, prompts, reference):
    with _engine(model, max_batch_size=96, split_fuse_token_num=40) as engine:
        outs = engine.generate_outputs(prompts, use_tqdm=False)
    _assert_same(outs, reference)


def test_prefix_cache_hit(model, prompts, reference):
    with _engine(model) as engine:
        engine.generate_outputs(prompts, use_tqdm=False)
        before = engine.stats().prefix_cache_hit_rate
        outs = engine.generate_outputs(prompts, use_tqdm=False)
        assert engine.stats().prefix_cache_hit_rate > before
    _assert_same(outs, reference)


def test_reset_prefix_cache(model, prompts, reference):
    """After a reset no prompt is served from the cache; requests running through a reset lose
    nothing (their blocks stay theirs)."""
    with _engine(model) as engine:
        engine.generate_outputs(prompts, use_tqdm=False)
        assert engine.reset_prefix_cache() > 0
        cold = engine.generate_outputs(prompts, use_tqdm=False)
        handles = [engine.submit(kt.Request(p)) for p in prompts]
        assert engine.reset_prefix_cache() > 0  # the cold run's blocks, some now in use
        running = [h.result(timeout=300) for h in handles]
        assert engine.stats().num_free_kv_blocks == 512
    assert [out.num_cached_tokens for out in cold] == [0] * len(prompts)
    _assert_same(cold, reference)
    _assert_same(running, reference)


@pytest.mark.parametrize("preempt_mode", [0, 1], ids=["swap", "recompute"])
def test_forced_preemption(model, prompts, reference, preempt_mode):
    # 16 blocks of 16 tokens: the short prompts are admitted, then their growth runs the pool dry.
    short = [i for i, p in enumerate(prompts) if len(model.tokenizer.encode(p)) < 100]
    with _engine(model, num_device_blocks=16, preempt_mode=preempt_mode) as engine:
        outs = engine.generate_outputs([prompts[i] for i in short], use_tqdm=False)
        stats = engine.stats()
        assert stats.num_preemptions > 0
        assert stats.num_free_kv_blocks == 16 and stats.num_swapped == 0
    _assert_same(outs, [reference[i] for i in short])
