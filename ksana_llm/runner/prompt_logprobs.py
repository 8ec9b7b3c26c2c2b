"""Prompt log-probs: each prompt token's raw log-prob under the logits before it, its rank and
the top-k alternatives, as vLLM's model runner computes them (log-probs whatever the engine's
logprobs_mode). A long prompt chunk goes a slice of rows at a time so the float32 work stays
bounded."""

from __future__ import annotations

import torch

from ksana_llm.runner.logprobs_mode import chosen_ranks

__all__ = ["TOKEN_LOGPROBS_CHUNK_ELEMENTS", "token_logprobs"]


# Elements of float32 log-probs token_logprobs works on at once (512 MiB): a prompt chunk's
# rows over a large vocabulary (8,192 x 151,936: 5 GB in float32, and more for the rank
# comparison) go a slice of rows at a time, well inside the memory the KV sizing leaves free.
TOKEN_LOGPROBS_CHUNK_ELEMENTS = 2**27


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int, *,
                   chunk_elements: int = TOKEN_LOGPROBS_CHUNK_ELEMENTS
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw log-probs of `token_ids` [N] under logits [N, V], their ranks (1 = most likely; a tie
    counts against the token, as in vLLM), and the top-k (values, ids) of each row (k may be 0):
    the entries of prompt log-probs (log-probs whatever the engine's logprobs_mode, as vLLM's
    model runner computes them). Rows go `chunk_elements // V` at a time (row-wise: the same
    numbers as all at once)."""
    token_ids = token_ids.to(logits.device)
    step = max(1, chunk_elements // max(1, logits.shape[1]))
    parts = [_token_logprobs_rows(logits[i:i + step], token_ids[i:i + step], k)
             for i in range(0, logits.shape[0], step)] or \
        [_token_logprobs_rows(logits, token_ids, k)]  # no rows: empty results of the right shapes
    if len(parts) == 1:
        return parts[0]
    chosen, ranks, values, ids = zip(*parts)
    return torch.cat(chosen), torch.cat(ranks), torch.cat(values), torch.cat(ids)


def _token_logprobs_rows(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    raw = torch.log_softmax(logits.float(), dim=-1)
    chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = chosen_ranks(raw, chosen)
    if k > 0:
        values, ids = torch.topk(raw, min(k, raw.shape[1]), dim=-1)
    else:
        values, ids = raw.new_empty((raw.shape[0], 0)), token_ids.new_empty((raw.shape[0], 0))
    return chosen, ranks, values, ids
