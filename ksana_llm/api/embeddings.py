"""Text embeddings from a generative model: what `Engine.embed` and `POST /v1/embeddings` return.

A prompt's embedding is the final norm's hidden state at its last token, L2-normalised: vLLM's
default pooling for decoder models, and how last-token embedding models (GTE-Qwen2,
Qwen3-Embedding) are trained to be used. The engine computes it as a forward-only request: no
sampling, one prefill, batched with whatever else runs.
"""

from __future__ import annotations

import torch

from ksana_llm.api.forward_outputs import ForwardTarget

# The last position's hidden state after the model's final norm.
EMBEDDING_TARGETS = (ForwardTarget("layernorm", slice_pos=[[-1, -1]]),)
# Every position's (the per-token tasks of vLLM's /pooling: token_embed, token_classify).
TOKEN_STATE_TARGETS = (ForwardTarget("layernorm", slice_pos=[[0, -1]]),)


def embedding_from_hidden(hidden: torch.Tensor) -> torch.Tensor:
    """The embedding of one prompt from its last-token hidden state: float32, unit length."""
    return torch.nn.functional.normalize(hidden.float().flatten(), dim=0)


def token_embeddings_from_hidden(states: torch.Tensor) -> torch.Tensor:
    """Each token's embedding from the prompt's hidden states [tokens, hidden]: float32, every
    row unit length (vLLM's token_embed)."""
    return torch.nn.functional.normalize(states.float(), dim=-1)
