"""Similarity scores between texts, from their embeddings: `Engine.score` and the server's
`/score` and `/rerank` routes.

As vLLM scores with an embedding model, a pair's score is the cosine similarity of the two texts'
embeddings (`api.embeddings`: the last token's final-norm state, unit length, so the cosine is
their dot product). Pairs are formed as vLLM forms them: one first text against every second
text (1:1 or 1:N), or the i-th of each list together (N:N).
"""

from __future__ import annotations

import torch


def score_pairs(num_first: int, num_second: int, *, first: str = "text_1",
                second: str = "text_2") -> list[tuple[int, int]]:
    """(i, j) index pairs into the two lists, or a ValueError naming the field at fault."""
    if num_first < 1:
        raise ValueError(f"{first} must hold at least one text")
    if num_second < 1:
        raise ValueError(f"{second} must hold at least one text")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first == num_second:
        return [(i, i) for i in range(num_first)]
    raise ValueError(f"{second} has {num_second} texts for {num_first} in {first}: give one "
                     f"{first} for any number of {second}, or as many of each")


def pair_scores(first: torch.Tensor, second: torch.Tensor,
                pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine of each pair of unit-length embeddings (rows of `first` and `second`)."""
    rows = torch.tensor([i for i, _ in pairs], dtype=torch.long)
    cols = torch.tensor([j for _, j in pairs], dtype=torch.long)
    return (first.float()[rows] * second.float()[cols]).sum(dim=-1).tolist()
