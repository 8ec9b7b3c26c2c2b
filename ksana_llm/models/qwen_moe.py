"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B).

Both put a `SparseMoeBlock` (softmax top-k routing, `norm_topk_prob` deciding renormalisation)
on every layer whose index is not in `mlp_only_layers` and is a multiple of
`decoder_sparse_step` (counting from 1); the other layers keep a dense MLP of
`intermediate_size`. Experts are `moe_intermediate_size` wide.
- Qwen2-MoE adds one shared expert (`shared_expert_intermediate_size`) scaled by
  `sigmoid(shared_expert_gate(x))`; its attention biases q/k/v (`qkv_bias`) but not the output.
- Qwen3-MoE has no shared expert; its attention is Qwen3's (RMSNorm on q and k heads).
Checkpoints store experts one by one (`mlp.experts.N.{gate,up,down}_proj.weight`) or, as
transformers 5 holds them, stacked; both load (see `FusedExperts`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ksana_llm.layers.moe import FusedExperts, GatedMLP, SparseMoeBlock
from ksana_llm.loader.quantized import input_scale_group
from ksana_llm.layers.moe_routers import SoftmaxTopKRouter
from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.parallel import SINGLE
from ksana_llm.models.llama import LlamaAttention, LlamaMLP
from ksana_llm.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """transformers' rule for which decoder layers of a Qwen MoE model are MoE layers."""
    num_experts = getattr(config, "num_experts", 0) or 0
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts > 0 and (layer_idx + 1) % step == 0)


def qwen_moe_block(config: Any, *, shared_expert: bool,
                   parallel: ParallelContext = SINGLE) -> SparseMoeBlock:
    act = getattr(config, "hidden_act", "silu")
    hidden, num_experts = config.hidden_size, config.num_experts
    # transformers' Qwen routers round the weights to the activation dtype before the combine.
    router = SoftmaxTopKRouter(hidden, num_experts, config.num_experts_per_tok,
                               renormalize=bool(getattr(config, "norm_topk_prob", False)),
                               weights_in_input_dtype=True)
    experts = FusedExperts(num_experts, hidden, config.moe_intermediate_size, act,
                           parallel=parallel, scale_group=input_scale_group(config))
    if not shared_expert:
        return SparseMoeBlock(router, experts, parallel=parallel)
    shared = GatedMLP(hidden, config.shared_expert_intermediate_size, act, parallel=parallel,
                      reduce_output=False, scale_group=input_scale_group(config))
    return SparseMoeBlock(router, experts, shared, nn.Linear(hidden, 1, bias=False),
                          parallel=parallel)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, qkv_bias=bool(getattr(config, "qkv_bias", True)),
                              o_bias=False, parallel=self.parallel)

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return qwen_moe_block(config, shared_expert=True, parallel=self.parallel)
        return LlamaMLP(config, layer_idx, parallel=self.parallel)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def window_of(config: Any) -> int | None:
        """transformers' Qwen3-MoE has no per-layer types: with `use_sliding_window` its one
        window applies to every layer, whatever `max_window_layers` says (released configs set
        it to the layer count, which the Qwen2/Qwen3 rule would read as no window at all)."""
        window = getattr(config, "sliding_window", None)
        return int(window) if window and getattr(config, "use_sliding_window", False) else None

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return qwen_moe_block(config, shared_expert=False, parallel=self.parallel)
        return LlamaMLP(config, layer_idx, parallel=self.parallel)
