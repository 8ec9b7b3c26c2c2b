"""Sampler tests, logits: greedy, penalties and warpers, every expected value from transformers'
logits processors or the OpenAI formula. Draws (distributions, seeds) and logprobs are in
tests/test_sampler_draws.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.sampler import Sampler, SamplingRow, process_logits, warp_logits

# Short local names for the shared helpers: the tests build many rows inline.
from tests.sampler_harness import hf_warpers as _hf_warpers
from tests.sampler_harness import sampling_row as _row
from tests.sampler_harness import seeded_randint as _randint
from tests.sampler_harness import seeded_randn as _randn


# ----------------------------------------------------------------------------- helpers


def _hf_process(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Reference for `process_logits` on one row ([1, V]): HF processors + OpenAI formula."""
    config = row.config
    ids = torch.tensor([row.prompt_token_ids + row.output_token_ids], dtype=torch.int64)
    out = logits.clone()
    if config.repetition_penalty != 1.0:
        out = RepetitionPenaltyLogitsProcessor(config.repetition_penalty)(ids, out)
    stop = list(row.eos_token_ids) + list(config.stop_token_ids)
    if config.min_new_tokens > 0 and stop:
        out = MinNewTokensLengthLogitsProcessor(
            prompt_length_to_skip=len(row.prompt_token_ids),
            min_new_tokens=config.min_new_tokens, eos_token_id=stop)(ids, out)
    counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.int64),
                            minlength=logits.shape[-1]).to(torch.float32)
    out = out - config.presence_penalty * (counts > 0).float() - config.frequency_penalty * counts
    return out


def _assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same -inf pattern, and close finite values."""
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = _randn(7, 300, seed=1, scale=4).to(dtype)
    configs = [GenerationConfig(), GenerationConfig(do_sample=True, temperature=0.0)]
    rows = [_row(configs[i % 2], prompt=[1, 2, 3]) for i in range(7)]
    out = Sampler(seed=0).sample(logits, rows)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.logprobs is None and out.top_logprobs is None
    lists = out.to_lists()
    assert lists.token_ids == logits.float().argmax(dim=-1).tolist()
    assert lists.logprobs is None and lists.ranks is None and lists.top is None


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    logits = _randn(6, 100, seed=2, scale=3)
    rows = [_row(GenerationConfig(do_sample=i % 2 == 1, temperature=0.8, top_k=5))
            for i in range(6)]
    out = Sampler(seed=0).sample(logits, rows)
    expected = logits.argmax(dim=-1)
    assert torch.equal(out.token_ids[0::2], expected[0::2])


def test_logits_not_mutated() -> None:
    logits = _randn(4, 50, seed=3, scale=2)
    before = logits.clone()
    rows = [
        _row(GenerationConfig(repetition_penalty=1.5, presence_penalty=0.5, min_new_tokens=2,
                              logprobs=2), prompt=[1, 2], output=[3], eos=(0,)),
        _row(GenerationConfig(do_sample=True, temperature=0.5, top_k=3, top_p=0.9, min_p=0.1)),
        _row(GenerationConfig(do_sample=True, frequency_penalty=1.0), output=[4, 4]),
        _row(GenerationConfig()),
    ]
    Sampler(seed=0).sample(logits, rows)
    process_logits(logits, rows)
    warp_logits(logits, rows)
    assert torch.equal(logits, before)


# ----------------------------------------------------------------------------- penalties


def test_repetition_penalty_matches_hf() -> None:
    vocab = 40
    logits = _randn(5, vocab, seed=4, scale=3)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.15]
    rows = [
        _row(GenerationConfig(repetition_penalty=p), prompt=_randint(vocab, 6 + i, seed=10 + i),
             output=_randint(vocab, 3 * i, seed=20 + i))
        for i, p in enumerate(penalties)
    ]
    processed = process_logits(logits, rows)
    expected = torch.cat([_hf_process(logits[i:i + 1], row) for i, row in enumerate(rows)])
    # Sanity: the reference really changes the penalised rows.
    assert not torch.equal(expected[1], logits[1])
    _assert_same_logits(processed, expected)
    out = Sampler().sample(logits, rows)
    assert torch.equal(out.token_ids, expected.argmax(dim=-1))


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = _randn(1, 30, seed=5, scale=1)
    top = int(logits.argmax())
    row = _row(GenerationConfig(repetition_penalty=100.0), prompt=[top])
    expected = _hf_process(logits, row)
    out = Sampler().sample(logits, [row])
    assert int(out.token_ids[0]) == int(expected.argmax()) != top


def test_presence_frequency_penalties_match_formula() -> None:
    vocab = 25
    logits = _randn(4, vocab, seed=6, scale=2)
    configs = [
        GenerationConfig(presence_penalty=0.8),
        GenerationConfig(frequency_penalty=0.6),
        GenerationConfig(presence_penalty=-0.5, frequency_penalty=1.5),
        GenerationConfig(presence_penalty=1.0, frequency_penalty=0.3, repetition_penalty=1.4),
    ]
    rows = [_row(c, prompt=_randint(vocab, 5, seed=30 + i), output=_randint(vocab, 12, seed=40 + i))
            for i, c in enumerate(configs)]
    processed = process_logits(logits, rows)
    expected = torch.cat([_hf_process(logits[i:i + 1], row) for i, row in enumerate(rows)])
    _assert_same_logits(processed, expected)
    # Presence/frequency look at the output only: a prompt-only token keeps its logit.
    prompt_only = set(rows[0].prompt_token_ids) - set(rows[0].output_token_ids)
    for t in prompt_only:
        assert processed[0, t] == logits[0, t]
    assert torch.equal(Sampler().sample(logits, rows).token_ids, expected.argmax(dim=-1))


def test_min_new_tokens_matches_hf() -> None:
    vocab = 20
    eos, stop = 3, 7
    logits = _randn(6, vocab, seed=7)
    logits[:, eos] = 50.0  # EOS would win greedily...
    logits[:, stop] = 40.0  # ...and then the stop token.
    rows = [
        _row(GenerationConfig(min_new_tokens=3, stop_token_ids=[stop]), prompt=[1, 2],
             output=[5] * n, eos=(eos,))
        for n in range(5)
    ] + [_row(GenerationConfig(min_new_tokens=3, repetition_penalty=1.2, stop_token_ids=[stop]),
              prompt=[eos, 4], output=[9], eos=(eos,))]
    processed = process_logits(logits, rows)
    expected = torch.cat([_hf_process(logits[i:i + 1], row) for i, row in enumerate(rows)])
    _assert_same_logits(processed, expected)
    chosen = Sampler().sample(logits, rows).token_ids
    assert torch.equal(chosen, expected.argmax(dim=-1))
    # Suppressed while fewer than 3 tokens were produced, free afterwards.
    assert chosen.tolist()[:5] == [int(expected[i].argmax()) for i in range(5)]
    assert eos not in chosen.tolist()[:3] and stop not in chosen.tolist()[:3]
    assert chosen.tolist()[3:5] == [eos, eos]


def test_min_new_tokens_on_sampling_rows() -> None:
    vocab = 10
    logits = torch.zeros(2000, vocab)
    logits[:, 0] = 5.0  # EOS dominates the distribution
    config = GenerationConfig(do_sample=True, min_new_tokens=1)
    rows = [_row(config, eos=(0,)) for _ in range(2000)]
    tokens = Sampler(seed=3).sample(logits, rows).token_ids
    assert not (tokens == 0).any()


# ----------------------------------------------------------------------------- warpers


_WARP_CONFIGS = [
    GenerationConfig(do_sample=True, temperature=0.7),
    GenerationConfig(do_sample=True, top_k=5),
    GenerationConfig(do_sample=True, top_p=0.8),
    GenerationConfig(do_sample=True, min_p=0.1),
    GenerationConfig(do_sample=True, temperature=1.3, top_k=10, top_p=0.9, min_p=0.05),
    GenerationConfig(do_sample=True, temperature=0.5, top_p=0.6),
    GenerationConfig(do_sample=True, top_k=1),
    GenerationConfig(do_sample=True, top_p=0.01),
    GenerationConfig(do_sample=True, top_k=1000),  # larger than the vocabulary
    GenerationConfig(do_sample=True, min_p=1.0),
    GenerationConfig(),  # greedy: passes through
    GenerationConfig(do_sample=True),  # sampling without filters
]


def test_warp_matches_hf() -> None:
    vocab = 64
    logits = _randn(len(_WARP_CONFIGS), vocab, seed=8, scale=3)
    rows = [_row(c) for c in _WARP_CONFIGS]
    warped = warp_logits(logits, rows)
    expected = torch.cat([_hf_warpers(c)(None, logits[i:i + 1].clone())
                          for i, c in enumerate(_WARP_CONFIGS)])
    _assert_same_logits(warped, expected)
    torch.testing.assert_close(warped.softmax(-1), expected.softmax(-1))


def test_top_k_keeps_ties_like_hf() -> None:
    logits = torch.tensor(_randint(4, 3 * 30, seed=9), dtype=torch.float32).view(3, 30)
    configs = [GenerationConfig(do_sample=True, top_k=k) for k in (1, 4, 11)]
    warped = warp_logits(logits, [_row(c) for c in configs])
    expected = torch.cat([_hf_warpers(c)(None, logits[i:i + 1].clone())
                          for i, c in enumerate(configs)])
    _assert_same_logits(warped, expected)


@pytest.mark.parametrize("top_p", [0.25, 0.5, 0.75])
def test_top_p_boundary_like_hf(top_p: float) -> None:
    """Uniform logits make the cumulative mass hit 1 - top_p exactly: HF keeps the token there."""
    logits = torch.zeros(1, 4)
    config = GenerationConfig(do_sample=True, top_p=top_p)
    warped = warp_logits(logits, [_row(config)])
    expected = _hf_warpers(config)(None, logits.clone())
    assert torch.isfinite(warped).sum() == torch.isfinite(expected).sum()


def test_warp_after_penalties_matches_hf_pipeline() -> None:
    vocab = 32
    logits = _randn(3, vocab, seed=10, scale=2)
    configs = [
        GenerationConfig(do_sample=True, temperature=0.8, top_k=8, repetition_penalty=1.3),
        GenerationConfig(do_sample=True, top_p=0.7, presence_penalty=0.5, frequency_penalty=0.5),
        GenerationConfig(do_sample=True, min_p=0.2, min_new_tokens=4, repetition_penalty=0.9),
    ]
    rows = [_row(c, prompt=_randint(vocab, 8, seed=50 + i), output=_randint(vocab, 3, seed=60 + i),
                 eos=(0, 1)) for i, c in enumerate(configs)]
    warped = warp_logits(process_logits(logits, rows), rows)
    expected = torch.cat([_hf_warpers(row.config)(None, _hf_process(logits[i:i + 1], row))
                          for i, row in enumerate(rows)])
    _assert_same_logits(warped, expected)
