"""Sampler tests: every expected value comes from transformers' logits processors or torch formulas.

The statistical tests use fixed seeds, so they are deterministic; the p-value threshold only
guards against a wrong distribution, not against bad luck.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    make_generator,
    process_logits,
    warp_logits,
)


# ----------------------------------------------------------------------------- helpers


def _row(config: GenerationConfig, prompt: list[int] | None = None,
         output: list[int] | None = None, generator: torch.Generator | None = None,
         eos: tuple[int, ...] = ()) -> SamplingRow:
    return SamplingRow(config=config, prompt_token_ids=list(prompt or []),
                       output_token_ids=list(output or []), generator=generator,
                       eos_token_ids=eos)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def _randint(high: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n,), generator=g).tolist()


def _hf_warpers(config: GenerationConfig) -> LogitsProcessorList:
    """The warpers `transformers.generate` would build for this config, in its order."""
    warpers = LogitsProcessorList()
    if config.greedy:
        return warpers
    if config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k > 0:
        warpers.append(TopKLogitsWarper(config.top_k, min_tokens_to_keep=1))
    if config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(config.top_p, min_tokens_to_keep=1))
    if config.min_p > 0.0:
        warpers.append(MinPLogitsWarper(config.min_p, min_tokens_to_keep=1))
    return warpers


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


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit over the support; p = Q(df/2, chi2/2) (upper regularised gamma)."""
    support = probs > 0
    n = counts.sum().to(torch.float64)
    expected = probs[support].to(torch.float64) * n
    observed = counts[support].to(torch.float64)
    chi2 = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(float(support.sum().item() - 1), dtype=torch.float64)
    return torch.special.gammaincc(df / 2, chi2 / 2).item()


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
    ids, lps, top = out.to_lists()
    assert ids == logits.float().argmax(dim=-1).tolist() and lps is None and top is None


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


_STAT_CONFIGS = {
    "temperature": GenerationConfig(do_sample=True, temperature=0.7),
    # Each filter keeps a different number of the 8 tokens (5, 4 and 6 here).
    "top_k": GenerationConfig(do_sample=True, top_k=5),
    "top_p": GenerationConfig(do_sample=True, top_p=0.8),
    "min_p": GenerationConfig(do_sample=True, min_p=0.1),
    "combined": GenerationConfig(do_sample=True, temperature=1.5, top_k=6, top_p=0.9, min_p=0.1),
}


def _stat_logits() -> torch.Tensor:
    # 8 tokens, spread enough that every kept token has a large expected count at 20k draws.
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    return torch.linspace(1.5, -1.5, 8)[order]


@pytest.mark.parametrize("name", list(_STAT_CONFIGS))
def test_sampling_distribution_chi_square(name: str) -> None:
    config = _STAT_CONFIGS[name]
    base = _stat_logits()
    n = 20_000
    probs = _hf_warpers(config)(None, base.unsqueeze(0).clone()).softmax(-1)[0]
    if name != "temperature":
        assert (probs == 0).any(), "the filter should remove something for this test to bite"
    rows = [_row(config)] * n
    tokens = Sampler(seed=1234).sample(base.expand(n, -1), rows).token_ids
    counts = torch.bincount(tokens, minlength=8)
    # Tokens outside the kept set never appear.
    assert counts[probs == 0].sum() == 0
    assert _chi_square_pvalue(counts, probs) > 1e-3


def test_seeded_rows_distribution_chi_square() -> None:
    """Per-request generators (one draw from each of many seeds) also sample the right law."""
    config = _STAT_CONFIGS["combined"]
    base = _stat_logits()
    n = 5_000
    probs = _hf_warpers(config)(None, base.unsqueeze(0).clone()).softmax(-1)[0]
    rows = [_row(config, generator=make_generator(seed, "cpu")) for seed in range(n)]
    tokens = Sampler(seed=0).sample(base.expand(n, -1), rows).token_ids
    counts = torch.bincount(tokens, minlength=8)
    assert counts[probs == 0].sum() == 0
    assert _chi_square_pvalue(counts, probs) > 1e-3


# ----------------------------------------------------------------------------- seeds


_VOCAB_SEED = 50
_STEPS = 20


def _step_logits(step: int, salt: int) -> torch.Tensor:
    """The logits a request sees at a step, a function of (step, request) only."""
    return _randn(_VOCAB_SEED, seed=1000 * salt + step, scale=1.5)


def _run(position: int, others: list[tuple[GenerationConfig, int | None]],
         sampler_seed: int | None) -> list[int]:
    """Decode the target request for _STEPS steps at `position` among `others`; its tokens."""
    target = GenerationConfig(do_sample=True, temperature=0.9, top_k=30, top_p=0.95,
                              repetition_penalty=1.1, seed=42)
    requests = [(c, s) for c, s in others]
    requests.insert(position, (target, target.seed))
    rows = [_row(c, prompt=[1, 2, 3], generator=None if s is None else make_generator(s, "cpu"))
            for c, s in requests]
    sampler = Sampler(seed=sampler_seed)
    for step in range(_STEPS):
        logits = torch.stack([_step_logits(step, salt=i if i != position else 999)
                              for i in range(len(rows))])
        tokens = sampler.sample(logits, rows).token_ids.tolist()
        for row, token in zip(rows, tokens):
            row.output_token_ids.append(token)
    return rows[position].output_token_ids


def test_seeded_request_is_batch_invariant() -> None:
    sampling = GenerationConfig(do_sample=True, temperature=1.0)
    others = [
        (sampling, None),
        (GenerationConfig(do_sample=True, top_p=0.5, presence_penalty=0.3), 7),
        (GenerationConfig(), None),  # greedy
        (sampling, 42),  # same seed, other logits: its own generator, no shared state
        (GenerationConfig(do_sample=True, min_p=0.2), None),
    ]
    alone = _run(0, [], sampler_seed=1)
    assert len(set(alone)) > 1  # it really samples
    for position in (0, 2, len(others)):
        for sampler_seed in (None, 5):
            assert _run(position, others, sampler_seed) == alone


def test_different_seeds_differ_and_sampler_seed_reproduces() -> None:
    base = _randn(_VOCAB_SEED, seed=77)
    config = GenerationConfig(do_sample=True)
    logits = base.expand(64, -1)

    def draw(generators: list[torch.Generator | None], sampler_seed: int | None) -> list[int]:
        rows = [_row(config, generator=g) for g in generators]
        return Sampler(seed=sampler_seed).sample(logits, rows).token_ids.tolist()

    a = draw([make_generator(1, "cpu") for _ in range(64)], None)
    b = draw([make_generator(2, "cpu") for _ in range(64)], None)
    assert len(set(a)) == 1 and a != b  # same seed -> same token, whatever the row
    assert draw([None] * 64, 3) == draw([None] * 64, 3)


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax() -> None:
    vocab = 60
    logits = _randn(5, vocab, seed=11, scale=3).to(torch.bfloat16)
    configs = [
        GenerationConfig(logprobs=0),
        GenerationConfig(logprobs=3, repetition_penalty=3.0),
        GenerationConfig(do_sample=True, top_k=10, logprobs=5, presence_penalty=2.0),
        GenerationConfig(do_sample=True, temperature=0.6),  # no logprobs asked
        GenerationConfig(logprobs=1),
    ]
    rows = [_row(c, prompt=_randint(vocab, 10, seed=70 + i), output=_randint(vocab, 4, seed=80 + i))
            for i, c in enumerate(configs)]
    out = Sampler(seed=0).sample(logits, rows)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    values, ids = torch.topk(raw, 5, dim=-1)
    assert out.top_logprobs is not None
    torch.testing.assert_close(out.top_logprobs[0], values)
    assert torch.equal(out.top_logprobs[1], ids)

    token_ids, logprobs, top = out.to_lists()
    assert token_ids == out.token_ids.tolist()
    # Exact: float32 values widen to Python floats without loss.
    assert logprobs == out.logprobs.tolist()
    assert top is not None
    assert top[0] == out.top_logprobs[0].tolist() and top[1] == ids.tolist()


def test_logprobs_zero_gives_empty_top() -> None:
    logits = _randn(2, 10, seed=12)
    out = Sampler().sample(logits, [_row(GenerationConfig(logprobs=0)), _row(GenerationConfig())])
    assert out.top_logprobs is not None and out.top_logprobs[0].shape == (2, 0)
    ids, lps, top = out.to_lists()
    assert top == ([[], []], [[], []])
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True))[:, 0]
    assert lps == pytest.approx(expected.tolist())


def test_output_type() -> None:
    out = Sampler().sample(_randn(1, 5, seed=13), [_row(GenerationConfig())])
    assert isinstance(out, SamplerOutput)
    with pytest.raises(ValueError):
        Sampler().sample(_randn(2, 5, seed=13), [_row(GenerationConfig())])


def test_math_sanity_of_pvalue_helper() -> None:
    # chi2 = 0 -> p = 1; a grossly wrong law -> p ~ 0 (guards the helper itself).
    probs = torch.full((4,), 0.25)
    assert _chi_square_pvalue(torch.tensor([250, 250, 250, 250]), probs) == pytest.approx(1.0)
    assert _chi_square_pvalue(torch.tensor([1000, 0, 0, 0]), probs) < 1e-10
    assert not math.isnan(_chi_square_pvalue(torch.tensor([240, 260, 250, 250]), probs))
