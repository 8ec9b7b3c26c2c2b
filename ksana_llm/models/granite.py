"""IBM Granite 3.x dense (`GraniteForCausalLM`): Llama's layers with four scalars from the
config, applied where transformers' Granite applies them:

- `embedding_multiplier`: every input embedding, token or given (`prompt_embeds`), times it;
- `attention_multiplier`: the softmax scale (in place of head_dim^-0.5);
- `residual_multiplier`: the attention and MLP outputs times it before each residual add;
- `logits_scaling`: the logits divided by it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.attention import AttentionMetadata, KVCache
from ksana_llm.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, Rope,
                                    input_norm, run_mlp)


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__(config, attention, mlp)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, rope: Rope | None, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return run_mlp(self.mlp, hidden, meta) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        super().__init__(config, parallel)
        self.model.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, scale=float(config.attention_multiplier),
                              parallel=self.parallel)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return GraniteDecoderLayer(config, self.make_attention(config, layer_idx),
                                   self.make_mlp(config, layer_idx))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / self.logits_scaling
