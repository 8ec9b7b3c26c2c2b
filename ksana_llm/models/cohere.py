"""Cohere Command R / R+ / Aya (`CohereForCausalLM`) and Command R7B / A (`Cohere2ForCausalLM`)
on the Llama block.

- One norm per layer (LayerNorm without a bias), whose output feeds attention and the MLP side
  by side; both outputs are added to the residual stream.
- RoPE pairs each head's dims as (0, 1), (2, 3), ... (GPT-J's rotation): the q/k rows are
  reordered to halves as they load (models/interleaved_rope.py); Command R+'s per-head q/k
  LayerNorms (`use_qk_norm`) take the same order.
- Logits are multiplied by `logit_scale`; the embedding is tied to the LM head.
- Cohere 2: `layer_types` mixes sliding-window layers, which rotate, with full layers, which
  take no positions at all (NoPE).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.attention import AttentionMetadata, KVCache
from ksana_llm.layers.norm import HeadwiseLayerNorm, LayerNormNoBias
from ksana_llm.layers.parallel import kv_head_shard
from ksana_llm.models.gemma import SLIDING, PerLayerWindows, layer_types
from ksana_llm.models.interleaved_rope import InterleavedRotaryRows
from ksana_llm.models.llama import LlamaAttention, LlamaForCausalLM, Rope, head_dim_of, run_mlp


class CohereAttention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, *, layer_window: int | None = None,
                 parallel: ParallelContext) -> None:
        super().__init__(config, layer_idx, layer_window=layer_window, parallel=parallel)
        if getattr(config, "use_qk_norm", False):
            d, eps = self.head_dim, config.layer_norm_eps
            total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            first_kv, _ = kv_head_shard(total_kv, parallel)
            self.q_norm = HeadwiseLayerNorm(
                config.num_attention_heads, (parallel.tp_rank * self.num_heads, self.num_heads),
                d, eps)
            self.k_norm = HeadwiseLayerNorm(total_kv, (first_kv, self.num_kv_heads), d, eps)
            self.qk_norm = True

    def _norm_weights(self, dtype: torch.dtype) -> None:
        return None  # LayerNorms: the fused RoPE kernel's norms are RMSNorms


class CohereDecoderLayer(nn.Module):
    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module, *,
                 rotates: bool = True) -> None:
        super().__init__()
        self.input_layernorm = LayerNormNoBias(config.hidden_size, config.layer_norm_eps)
        self.self_attn = attention
        self.mlp = mlp
        self.rotates = rotates  # False: a NoPE layer (Cohere 2's full layers)
        self.local_rope = False  # read by LlamaModel: one RoPE table

    def forward(self, rope: Rope | None, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, None]:
        # The stream is whole after every layer here: no residual travels beside it.
        if residual is not None:
            hidden = hidden + residual
        normed = self.input_layernorm(hidden)
        attended = self.self_attn(rope if self.rotates else None, normed, kv_cache, meta)
        return hidden + attended + run_mlp(self.mlp, normed, meta), None


class CohereForCausalLM(InterleavedRotaryRows, LlamaForCausalLM):
    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        self._rotary_dim = head_dim_of(config)
        super().__init__(config, parallel)
        if self.parallel.is_last_stage:
            self.model.norm = LayerNormNoBias(config.hidden_size, config.layer_norm_eps)
        self.logit_scale = float(getattr(config, "logit_scale", 1.0))

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return CohereAttention(config, layer_idx, parallel=self.parallel)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return CohereDecoderLayer(config, self.make_attention(config, layer_idx),
                                  self.make_mlp(config, layer_idx))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        return super().load_weights(self.rotary_rows_as_halves(weights), require_all=require_all)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits * self.logit_scale


class Cohere2ForCausalLM(PerLayerWindows, CohereForCausalLM):
    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        self._types = layer_types(config)  # checked before any weight is built
        super().__init__(config, parallel)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return CohereAttention(config, layer_idx, layer_window=self._window_of(config, layer_idx),
                               parallel=self.parallel)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return CohereDecoderLayer(config, self.make_attention(config, layer_idx),
                                  self.make_mlp(config, layer_idx),
                                  rotates=self._types[layer_idx] == SLIDING)
