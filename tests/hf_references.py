"""What transformers computes on the same weights, for the tests to compare against."""

from __future__ import annotations

import torch


def hf_embedding(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' last-token hidden state after the final norm, L2-normalised: the embedding
    `/v1/embeddings` must return for these token ids."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0)
