"""Speculative decoding with drafts from the sequence itself (`speculative_method="ngram"`).

The proposer is checked against a plain scan of the history; the engine, on the real default
model, against transformers' greedy tokens, with fewer forward steps than without drafts on text
that repeats its prompt. (Verification itself, greedy and sampled, is the MTP method's and is
tested in tests/test_speculative_decoding.py.)
"""

from __future__ import annotations

import random

import pytest
import torch

import ksana_llm as kt
from ksana_llm.engine.ngram_proposer import NgramIndex, NgramProposer

COPY_PROMPTS = [
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the "
    "river bank.",
    "Copy the list: apples, bananas, cherries, dates, elderberries, figs, grapes.",
]


def scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The proposal by brute force: the longest n whose last-n tokens occur earlier, its
    latest such occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_proposals_equal_a_plain_scan_as_the_sequence_grows():
    rng = random.Random(0)
    proposer = NgramProposer(min_n=1, max_n=3)
    for trial in range(20):
        tokens = [rng.randrange(6) for _ in range(5)]
        index = NgramIndex()  # grown step by step, as the engine grows it
        for _ in range(40):
            assert proposer.propose(tokens, index, 4) == scan(tokens, 4, 1, 3), (trial, tokens)
            tokens.append(rng.randrange(6))


def test_reference_lookups_follow_the_prediction_in_order():
    proposer = NgramProposer(min_n=1, max_n=2)
    reference = proposer.index_reference([7, 1, 2, 7, 3, 4, 7, 5])
    # "7" occurs three times: the first at or after the cursor (0) wins, then reading goes on.
    assert proposer.propose_from_reference([9, 7], reference, 2) == [1, 2]
    assert proposer.propose_from_reference([9, 7, 1, 2, 7], reference, 2) == [3, 4]
    assert proposer.propose_from_reference([2, 7], reference, 2) == [3, 4]  # "2 7": longest
    assert proposer.propose_from_reference([0, 5], reference, 3) == []  # nothing after it
    assert proposer.propose_from_reference([0, 8], reference, 3) == []  # not in it


def test_longest_and_latest_match_wins():
    proposer = NgramProposer(min_n=1, max_n=3)
    # "1 2 3" occurred before; "3" alone occurred later (followed by 9): the 3-gram wins.
    assert proposer.propose([1, 2, 3, 7, 7, 3, 9, 5, 1, 2, 3], NgramIndex(), 2) == [7, 7]
    # The latest occurrence of "4 5": followed by 8, not 6.
    assert proposer.propose([4, 5, 6, 4, 5, 8, 0, 4, 5], NgramIndex(), 1) == [8]
    assert proposer.propose([1, 2, 3], NgramIndex(), 3) == []  # nothing repeats
    assert NgramProposer(min_n=2, max_n=2).propose([5, 1, 5], NgramIndex(), 1) == []
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(min_n=3, max_n=2)


def _steps(engine: kt.Engine) -> list[int]:
    """Counts the engine's forward steps (wraps the core's step)."""
    count = [0]
    step = engine._core.step

    def counting(*args, **kwargs):
        count[0] += 1
        return step(*args, **kwargs)

    engine._core.step = counting
    return count


@pytest.mark.parametrize("num_drafts", [2, 5])
def test_greedy_tokens_equal_transformers_in_fewer_steps(default_model, hf_default_model,
                                                          num_drafts):
    tok = default_model.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True, tokenize=False)
               for p in COPY_PROMPTS]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    config = kt.GenerationConfig(max_new_tokens=40)
    expected = []
    for prompt in ids:
        with torch.no_grad():
            out = hf_default_model.generate(torch.tensor([prompt]), max_new_tokens=40,
                                            do_sample=False,
                                            attention_mask=torch.ones(1, len(prompt)))
        expected.append(out[0, len(prompt):].tolist())
    counts = {}
    for method in ("none", "ngram"):
        settings = dict(speculative_method="ngram", num_speculative_tokens=num_drafts) \
            if method == "ngram" else {}
        with kt.Engine(default_model, num_device_blocks=256, **settings) as engine:
            steps = _steps(engine)
            got = [engine.generate_outputs([p], config, use_tqdm=False)[0].token_ids
                   for p in ids]
            counts[method] = steps[0]
            stats = engine.stats()
        assert got == expected, method
    assert stats.num_accepted_draft_tokens > 0 and stats.draft_acceptance_rate > 0.3
    assert counts["ngram"] < 0.75 * counts["none"], counts


def test_batches_mix_drafting_and_sampled_requests(default_model):
    """Sampled requests, penalties (no drafts) and stop tokens among accepted drafts share the
    steps of drafting ones; every request ends as its settings say."""
    tok = default_model.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": COPY_PROMPTS[1]}],
                                     add_generation_prompt=True, tokenize=False)
    configs = [kt.GenerationConfig(max_new_tokens=24),
               kt.GenerationConfig(max_new_tokens=24, do_sample=True, temperature=0.7, seed=3),
               kt.GenerationConfig(max_new_tokens=24, repetition_penalty=1.3),
               kt.GenerationConfig(max_new_tokens=5, ignore_eos=True)]
    with kt.Engine(default_model, num_device_blocks=256, speculative_method="ngram",
                   num_speculative_tokens=4) as engine:
        outs = engine.generate_outputs([prompt] * len(configs), configs, use_tqdm=False)
        alone = engine.generate_outputs([prompt], [configs[1]], use_tqdm=False)[0]
    assert all(0 < len(o.token_ids) <= c.max_new_tokens for o, c in zip(outs, configs))
    assert len(outs[3].token_ids) == 5
    # A seeded sample is the same in a busy batch as alone (drafts do not change its stream).
    assert outs[1].token_ids == alone.token_ids


def test_seeded_samples_are_those_without_drafts(default_model):
    """A seeded sample draws position t's noise from (seed, t) alone, and a draft stands where
    it is that draw's token: with drafts accepted, the samples (n = 2: seeds s and s + 1) are
    the engine's without speculative decoding."""
    prompt = default_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": COPY_PROMPTS[1]}], add_generation_prompt=True,
        tokenize=False)
    config = kt.GenerationConfig(max_new_tokens=32, do_sample=True, temperature=0.5, seed=11,
                                 num_return_sequences=2)
    samples = {}
    for drafts in (0, 4):
        settings = dict(speculative_method="ngram", num_speculative_tokens=drafts) \
            if drafts else {}
        with kt.Engine(default_model, num_device_blocks=256, **settings) as engine:
            output = engine.generate_outputs([prompt], config, use_tqdm=False)[0]
            stats = engine.stats()
        samples[drafts] = [s.token_ids for s in output.sequences]
    assert stats.num_accepted_draft_tokens > 0
    assert samples[4] == samples[0]
    assert samples[0][0] != samples[0][1]


def test_a_predicted_output_drafts_its_own_tokens(default_model, hf_default_model):
    """OpenAI's Predicted Outputs: with the expected answer as `prediction`, a text that does
    not copy its prompt is drafted from the prediction (most drafts accepted, far fewer
    steps); a wrong prediction costs steps, never tokens: both give transformers' tokens."""
    tok = default_model.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about "
                                       "the sea."}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        out = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                        attention_mask=torch.ones(1, len(ids)))
    expected = out[0, len(ids):].tolist()
    config = kt.GenerationConfig(max_new_tokens=48)
    runs = {}
    with kt.Engine(default_model, num_device_blocks=256, speculative_method="ngram",
                   num_speculative_tokens=4) as engine:
        for name, prediction in (("none", None), ("right", tok.decode(expected)),
                                 ("wrong", "Roses are red, violets are blue. " * 3)):
            before = engine.stats()
            steps = _steps(engine)
            output = engine.submit(kt.Request(ids, config, prediction=prediction)).result(60)
            after = engine.stats()
            runs[name] = (output.token_ids, steps[0],
                          after.num_accepted_draft_tokens - before.num_accepted_draft_tokens)
        with pytest.raises(ValueError, match="prediction"):
            engine.submit(kt.Request(ids, config, prediction=[10**9]))
    assert all(tokens == expected for tokens, _, _ in runs.values())
    assert runs["right"][1] < 0.5 * runs["none"][1], runs
    assert runs["right"][2] > 0.7 * len(expected) > runs["none"][2]


def test_large_batches_pause_drafting(default_model):
    """With speculative_disable_by_batch_size=3, a batch of three never drafts (and gives the
    tokens of an engine without speculation), while the same engine drafts for two."""
    tok = default_model.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True, tokenize=False)
               for p in COPY_PROMPTS + [COPY_PROMPTS[0].replace("fox", "cat")]]
    # ignore_eos: the three end together, so the batch never shrinks below three.
    config = kt.GenerationConfig(max_new_tokens=24, ignore_eos=True)
    with kt.Engine(default_model, num_device_blocks=256) as engine:
        plain = [o.token_ids for o in engine.generate_outputs(prompts, config, use_tqdm=False)]
    with kt.Engine(default_model, num_device_blocks=256, speculative_method="ngram",
                   num_speculative_tokens=4, speculative_disable_by_batch_size=3) as engine:
        got = [o.token_ids for o in engine.generate_outputs(prompts, config, use_tqdm=False)]
        assert engine.stats().num_draft_tokens == 0
        assert got == plain
        engine.generate_outputs(prompts[:2], config, use_tqdm=False)
        assert engine.stats().num_accepted_draft_tokens > 0


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        kt.EngineConfig(speculative_method="ngram", num_speculative_tokens=2,
                        speculative_disable_by_batch_size=1)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        kt.EngineConfig(speculative_method="ngram", num_speculative_tokens=2,
                        prompt_lookup_min=5, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="speculative_method"):
        kt.EngineConfig(speculative_method="eagle", num_speculative_tokens=2)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_parallel_engines_draft_from_history(tmp_path, parallel):
    """Over two gloo ranks (tensor or pipeline parallel) the drafted steps give transformers'
    greedy tokens: a tiny random model falls into loops, which prompt lookup predicts."""
    from tests.family_harness import greedy_trace, hf_reference
    from tests.tiny_models import build_tiny_model

    hf = build_tiny_model("yi-gqa4-bias", tmp_path / "tiny")
    prompts = [[1, 5, 9, 33, 17, 5, 9, 33, 17, 5], [1, 77, 12, 250, 31, 77, 12]]
    expected = [greedy_trace(hf_reference(hf), p, 24)[0][len(p):] for p in prompts]
    model = kt.Model.from_pretrained(tmp_path / "tiny", device="cpu", dtype="float32",
                                     progress=False, **parallel)
    config = kt.GenerationConfig(max_new_tokens=24, ignore_eos=True)
    with kt.Engine(model, generation_config=config, block_token_num=4, num_device_blocks=128,
                   speculative_method="ngram", num_speculative_tokens=3) as engine:
        got = [o.token_ids for o in engine.generate_outputs(prompts, use_tqdm=False)]
        stats = engine.stats()
    assert got == expected
    assert stats.num_accepted_draft_tokens > 0


def test_a_steps_accepted_drafts_arrive_as_one_delta(default_model):
    """The tokens one step accepts stream as one delta (vLLM's way), not one delta per token:
    fewer deltas than tokens, each with its tokens' log-probs, the same text and tokens as the
    finished output; also when output processing overlaps the next step (deferred outputs)."""
    tok = default_model.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": COPY_PROMPTS[0]}],
                                     add_generation_prompt=True, tokenize=False)
    config = kt.GenerationConfig(max_new_tokens=32, logprobs=1)
    for overlap in (False, True):
        with kt.Engine(default_model, num_device_blocks=256, speculative_method="ngram",
                       num_speculative_tokens=4, overlap_output_processing=overlap) as engine:
            steps = _steps(engine)
            handle = engine.submit(kt.Request(prompt, config))
            deltas = list(handle.deltas())
            final = handle.result()
        assert [t for d in deltas for t in d.token_ids] == final.token_ids
        assert "".join(d.text for d in deltas) == final.text
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
        # Each step's tokens in one delta: as many deltas as steps, fewer than tokens.
        assert len(deltas) <= steps[0] < len(final.token_ids), (overlap, steps, deltas)
        assert max(len(d.token_ids) for d in deltas) > 1
