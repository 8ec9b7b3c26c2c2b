"""Sampler tests, draws: the sampled distributions (chi-square against transformers' warpers),
per-request seeds (batch invariance, reproducibility) and logprobs. The statistical tests use
fixed seeds, so they are deterministic; the p-value threshold only guards against a wrong
distribution, not against bad luck.
"""

from __future__ import annotations

import math

import pytest
import torch

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.sampled_tokens import SamplerOutput
from ksana_llm.runner.sampler import Sampler, SeededDraws, seeded_draws

# Short local names for the shared helpers: the tests build many rows inline.
from tests.sampler_harness import chi_square_pvalue as _chi_square_pvalue
from tests.sampler_harness import hf_warpers as _hf_warpers
from tests.sampler_harness import sampling_row as _row
from tests.sampler_harness import seeded_randint as _randint
from tests.sampler_harness import seeded_randn as _randn


# ----------------------------------------------------------------------------- distributions


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
    rows = [_row(config, draws=seeded_draws(seed, "cpu")) for seed in range(n)]
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
    rows = [_row(c, prompt=[1, 2, 3], draws=None if s is None else seeded_draws(s, "cpu"))
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

    def draw(draws: list[SeededDraws | None], sampler_seed: int | None) -> list[int]:
        rows = [_row(config, draws=d) for d in draws]
        return Sampler(seed=sampler_seed).sample(logits, rows).token_ids.tolist()

    a = draw([seeded_draws(1, "cpu") for _ in range(64)], None)
    b = draw([seeded_draws(2, "cpu") for _ in range(64)], None)
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

    # Ranks among the whole row, from 1; a tie counts against the token (vLLM's rule).
    chosen = raw.gather(1, out.token_ids[:, None])
    assert out.ranks.tolist() == (raw >= chosen).sum(dim=1).tolist()
    assert out.ranks.tolist() == [sorted(r, reverse=True).index(c) + 1 for r, c in
                                  zip(raw.tolist(), chosen[:, 0].tolist())]  # (no ties here)

    lists = out.to_lists()
    assert lists.token_ids == out.token_ids.tolist() and lists.ranks == out.ranks.tolist()
    # Exact: float32 values widen to Python floats without loss.
    assert lists.logprobs == out.logprobs.tolist()
    assert lists.top is not None
    assert lists.top[0] == out.top_logprobs[0].tolist() and lists.top[1] == ids.tolist()


def test_logprobs_zero_gives_empty_top() -> None:
    logits = _randn(2, 10, seed=12)
    out = Sampler().sample(logits, [_row(GenerationConfig(logprobs=0)), _row(GenerationConfig())])
    assert out.top_logprobs is not None and out.top_logprobs[0].shape == (2, 0)
    lists = out.to_lists()
    assert lists.top == ([[], []], [[], []]) and lists.ranks == [1, 1]  # greedy: the top one
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True))[:, 0]
    assert lists.logprobs == pytest.approx(expected.tolist())


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
