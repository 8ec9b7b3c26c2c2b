"""AllenAI OLMo 2 (`Olmo2ForCausalLM`) and OLMo 3 (`Olmo3ForCausalLM`) on the Llama block.

- No norm before attention or the MLP: each one's output is normalised (`post_attention_layernorm`,
  `post_feedforward_layernorm`) and added to the residual stream.
- q and k are normalised as whole projections, all heads together (`q_norm` over
  num_heads * head_dim, `k_norm` over num_kv_heads * head_dim), before RoPE; under tensor
  parallelism each rank normalises its heads with the sum of squares of every rank's
  (`ShardedRMSNorm`).
- OLMo 3 adds Gemma 2's per-layer attention kinds: `layer_types` lists sliding-window and full
  layers, each kind with its own RoPE parameters.

LG EXAONE 4.0 (`Exaone4ForCausalLM`) shares the layout, with q/k RMSNorms per head (Qwen3's) and,
when it has a sliding window, full layers that take no positions (NoPE).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.attention import AttentionMetadata, KVCache
from ksana_llm.layers.norm import RMSNorm, ShardedRMSNorm
from ksana_llm.layers.parallel import kv_head_shard
from ksana_llm.models.gemma import SLIDING, PerLayerWindows, RopePerLayerKind, layer_types
from ksana_llm.models.llama import LlamaAttention, LlamaForCausalLM, Rope, run_mlp


class Olmo2Attention(LlamaAttention):
    norms_whole_projections = True

    def __init__(self, config: Any, layer_idx: int, *, layer_window: int | None = None,
                 parallel: ParallelContext) -> None:
        super().__init__(config, layer_idx, layer_window=layer_window, parallel=parallel)
        d, eps = self.head_dim, getattr(config, "rms_norm_eps", 1e-6)
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        first_kv, _ = kv_head_shard(total_kv, parallel)
        self.q_norm = ShardedRMSNorm(total_heads * d, (parallel.tp_rank * self.num_heads * d,
                                                       self.num_heads * d), eps, parallel)
        self.k_norm = ShardedRMSNorm(total_kv * d, (first_kv * d, self.num_kv_heads * d), eps,
                                     parallel, replicas=max(1, parallel.tp_size // total_kv))


class Olmo2DecoderLayer(nn.Module):
    """`rotates` False: a layer that takes no positions (EXAONE 4's full layers)."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module, *,
                 local_rope: bool = False, rotates: bool = True) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.local_rope = local_rope  # read by LlamaModel: which RoPE table this layer takes
        self.rotates = rotates

    def forward(self, rope: Rope | None, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, None]:
        # The stream is whole after every layer here: no residual travels beside it.
        if residual is not None:
            hidden = hidden + residual
        attended = self.self_attn(rope if self.rotates else None, hidden, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(run_mlp(self.mlp, hidden, meta)), None


class Olmo2ForCausalLM(LlamaForCausalLM):
    norm_weights_in_float32 = True  # transformers' Olmo2RMSNorm / Olmo3RMSNorm

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return Olmo2Attention(config, layer_idx, parallel=self.parallel)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return Olmo2DecoderLayer(config, self.make_attention(config, layer_idx),
                                 self.make_mlp(config, layer_idx))


class Olmo3ForCausalLM(RopePerLayerKind, Olmo2ForCausalLM):
    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        self._types = layer_types(config)  # checked before any weight is built
        super().__init__(config, parallel)
        self.install_rope_tables(config)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return Olmo2Attention(config, layer_idx, layer_window=self._window_of(config, layer_idx),
                              parallel=self.parallel)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return Olmo2DecoderLayer(config, self.make_attention(config, layer_idx),
                                 self.make_mlp(config, layer_idx),
                                 local_rope=self._types[layer_idx] == SLIDING)


class Exaone4ForCausalLM(PerLayerWindows, Olmo2ForCausalLM):
    norm_weights_in_float32 = False  # transformers' Exaone4RMSNorm rounds first, as Llama's

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        self._types = layer_types(config)  # checked before any weight is built
        super().__init__(config, parallel)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, qk_norm=True,
                              layer_window=self._window_of(config, layer_idx),
                              parallel=self.parallel)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        # transformers' rule: every layer rotates unless the model has a window, in which case
        # only the windowed ones do.
        rotates = config.sliding_window is None or self._types[layer_idx] == SLIDING
        return Olmo2DecoderLayer(config, self.make_attention(config, layer_idx),
                                 self.make_mlp(config, layer_idx), rotates=rotates)
