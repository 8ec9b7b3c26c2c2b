"""BigCode StarCoder 2 3B / 7B / 15B (`Starcoder2ForCausalLM`) on the Llama block.

- LayerNorms with a bias (before attention, before the MLP, and at the end), not RMSNorms.
- A plain MLP, `c_fc` -> `hidden_act` (gelu, tanh-approximated) -> `c_proj`, with biases;
  under tensor parallelism `c_fc` is split by columns and `c_proj` by rows, like gate/up/down.
- Biases on q/k/v and the output projection (`use_bias`); the config's `sliding_window` (4096
  in the 3B / 7B, null in the 15B) on every layer, as transformers applies it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.activation import get_activation
from ksana_llm.layers.attention import AttentionMetadata, KVCache
from ksana_llm.layers.linear import MergedLinear
from ksana_llm.layers.parallel import SINGLE, RowParallelLinear, scale_aligned_split
from ksana_llm.loader.quantized import input_scale_group
from ksana_llm.models.llama import LlamaAttention, MistralForCausalLM, Rope, run_mlp


class Starcoder2MLP(nn.Module):
    def __init__(self, config: Any, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        size, bias = config.intermediate_size, bool(getattr(config, "use_bias", True))
        shard = scale_aligned_split(size, parallel, input_scale_group(config))
        self.c_fc = MergedLinear(config.hidden_size, [size], bias=bias, shards=[shard])
        self.c_proj = RowParallelLinear(size, config.hidden_size, bias=bias, ctx=parallel,
                                        in_shard=shard)
        self.act = get_activation(getattr(config, "hidden_act", "gelu_pytorch_tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        eps = getattr(config, "norm_epsilon", 1e-5)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = attention
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = mlp
        self.local_rope = False  # read by LlamaModel: one RoPE table

    def forward(self, rope: Rope | None, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, None]:
        # The stream is whole after every layer here: no residual travels beside it.
        if residual is not None:
            hidden = hidden + residual
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + run_mlp(self.mlp, self.post_attention_layernorm(hidden), meta), None


class Starcoder2ForCausalLM(MistralForCausalLM):
    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        super().__init__(config, parallel)
        if self.parallel.is_last_stage:
            self.model.norm = nn.LayerNorm(config.hidden_size,
                                           eps=getattr(config, "norm_epsilon", 1e-5))

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        bias = bool(getattr(config, "use_bias", True))
        return LlamaAttention(config, layer_idx, qkv_bias=bias, o_bias=bias,
                              parallel=self.parallel)

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return Starcoder2MLP(config, self.parallel)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return Starcoder2DecoderLayer(config, self.make_attention(config, layer_idx),
                                      self.make_mlp(config, layer_idx))
