"""Shared helpers of the sampler tests (tests/test_sampler.py, tests/test_sampler_draws.py):
rows, seeded random inputs, the warpers transformers' `generate` builds, and a chi-square test."""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.sampler import SamplingRow, SeededDraws


def sampling_row(config: GenerationConfig, prompt: list[int] | None = None,
         output: list[int] | None = None, draws: SeededDraws | None = None,
         eos: tuple[int, ...] = ()) -> SamplingRow:
    return SamplingRow(config=config, prompt_token_ids=list(prompt or []),
                       output_token_ids=list(output or []), draws=draws,
                       eos_token_ids=eos)


def seeded_randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def seeded_randint(high: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n,), generator=g).tolist()


def hf_warpers(config: GenerationConfig) -> LogitsProcessorList:
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


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit over the support; p = Q(df/2, chi2/2) (upper regularised gamma)."""
    support = probs > 0
    n = counts.sum().to(torch.float64)
    expected = probs[support].to(torch.float64) * n
    observed = counts[support].to(torch.float64)
    chi2 = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(float(support.sum().item() - 1), dtype=torch.float64)
    return torch.special.gammaincc(df / 2, chi2 / 2).item()
