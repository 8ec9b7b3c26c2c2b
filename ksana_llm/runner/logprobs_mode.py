"""What the log-probs a request asks for report: vLLM's `logprobs_mode`, one per engine.

- "raw_logprobs" (the default): log_softmax of the model's logits, before any processing;
- "raw_logits": the model's logits themselves;
- "processed_logprobs": log_softmax of the logits the token was chosen from: after the
  processors (penalties, bans, bias, grammar, the engine's and the request's own processors)
  and, for sampled rows, temperature, top-k, top-p and min-p (tokens they remove are -inf);
- "processed_logits": those processed logits themselves.

The chosen token's value, the top ones and the cumulative sum all come from the same tensor.
Prompt log-probs stay log-probs in every mode, as vLLM's model runner computes them. Beam
search reports what it ranks by in the processed modes: the processed log-probs (transformers'
processors run on log-probs), as they are for processed_logits, renormalised for
processed_logprobs; a beam's cumulative_logprob stays the sum it was ranked by.
"""

from __future__ import annotations

import torch

__all__ = ["LOGPROBS_MODES", "check_logprobs_mode", "chosen_ranks", "reported_values",
           "reports_logits"]

# config.LogprobsMode spells the same (the config sits above the runner; a test holds them equal).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def check_logprobs_mode(mode: str) -> str:
    """`mode`, or a ValueError naming the accepted ones."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                         f"got {mode!r}")
    return mode


def reports_logits(mode: str) -> bool:
    """Whether `mode` reports logits rather than log-probs."""
    return mode.endswith("_logits")


def reported_values(mode: str, raw_logits: torch.Tensor, processed: torch.Tensor | None
                    ) -> torch.Tensor:
    """float32 [B, V]: what `mode` reports for each row, from the model's `raw_logits` and the
    `processed` logits each row's token was chosen from (None: the raw ones)."""
    source = raw_logits if processed is None or mode.startswith("raw_") else processed
    source = source.float()
    return source if reports_logits(mode) else torch.log_softmax(source, dim=-1)


def chosen_ranks(values: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the rank of each row's `chosen` value among its `values` [B, V] (1 = the
    largest; a tie counts against the chosen token, as in vLLM)."""
    return (values >= chosen.unsqueeze(1)).sum(dim=1)
