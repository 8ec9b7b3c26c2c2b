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


def hf_greedy_tokens(hf_model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation (`generate`, no sampling) of each prompt, as token ids."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            gen = hf_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out
