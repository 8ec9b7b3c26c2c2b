"""SmolLM3 (`SmolLM3ForCausalLM`): Llama's layers, every `no_rope_layer_interval`-th of them
(`no_rope_layers[i] == 0`) attending without RoPE (NoPE); a sliding window on the layers
`layer_types` marks (only with `use_sliding_window`, off in the released 3B)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.attention import AttentionMetadata, KVCache
from ksana_llm.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    Rope,
)


class NoPEDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose attention sees no RoPE table (its q and k carry no positions)."""

    def forward(self, rope: Rope | None, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(None, hidden, residual, kv_cache, meta)


def _rope_layers(config: Any) -> list[bool]:
    flags = list(getattr(config, "no_rope_layers", None) or [])
    if len(flags) != config.num_hidden_layers:
        raise ValueError(f"no_rope_layers must have {config.num_hidden_layers} entries (1: RoPE, "
                         f"0: none), got {flags}")
    return [bool(flag) for flag in flags]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        self._uses_rope = _rope_layers(config)  # checked before any weight is built
        super().__init__(config, parallel)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        types = list(getattr(config, "layer_types", None) or [])
        windowed = (getattr(config, "use_sliding_window", False) and config.sliding_window
                    and layer_idx < len(types) and types[layer_idx] == "sliding_attention")
        return LlamaAttention(config, layer_idx, parallel=self.parallel,
                              layer_window=config.sliding_window if windowed else None)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        layer_class = LlamaDecoderLayer if self._uses_rope[layer_idx] else NoPEDecoderLayer
        return layer_class(config, self.make_attention(config, layer_idx),
                           self.make_mlp(config, layer_idx))
