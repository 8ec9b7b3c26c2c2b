"""What transformers computes on the same weights, for the tests to compare against."""

from __future__ import annotations

import torch


def hf_last_token_state(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' last-token hidden state after the final norm (an un-normalised embedding,
    `"normalize": false`)."""
    with torch.no_grad():
        return hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]


def hf_embedding(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' last-token hidden state after the final norm, L2-normalised: the embedding
    `/v1/embeddings` must return for these token ids."""
    return torch.nn.functional.normalize(hf_last_token_state(hf_model, ids), dim=0)
