"""Scores between texts: `Engine.score` and the server's `/score` and `/rerank` routes.

As vLLM scores, with an embedding model (any language model here) a pair's score is the cosine
similarity of the two texts' embeddings (`api.embeddings`: the last token's final-norm state,
unit length, so the cosine is their dot product); with a cross-encoder (a one-label
sequence-classification model, a reranker) it is the model's probability for the two texts
read together as one prompt (`cross_encoder_prompt`). Pairs are formed as vLLM forms them: one
first text against every second text (1:1 or 1:N), or the i-th of each list together (N:N).
"""

from __future__ import annotations

from typing import Any

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


def cross_encoder_prompt(tokenizer: Any, first: str | list[int], second: str | list[int]
                         ) -> list[int]:
    """A text pair as one cross-encoder prompt: two strings as the tokenizer encodes a text pair
    (`tokenizer(text_1, text_2)`, its special tokens and separators included: how the model
    was trained, and what vLLM feeds it); token ids, given for either text, joined as they are
    (a string beside them encoded without special tokens)."""
    if isinstance(first, str) and isinstance(second, str):
        if tokenizer is None:
            raise ValueError("text_1: this engine has no tokenizer; give token ids")
        return list(tokenizer(first, second)["input_ids"])
    parts = []
    for text in (first, second):
        if isinstance(text, str):
            if tokenizer is None:
                raise ValueError("text_1: this engine has no tokenizer; give token ids")
            text = list(tokenizer.encode(text, add_special_tokens=False))
        parts.append(list(text))
    return parts[0] + parts[1]
