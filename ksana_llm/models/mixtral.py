"""Mixtral (8x7B, 8x22B): the Llama/Mistral block with a sparse MoE in place of the MLP.

Softmax top-k routing with renormalised weights over `num_local_experts` gated experts. Hub
checkpoints name the block `block_sparse_moe` (experts `w1` gate, `w3` up, `w2` down); transformers
5 names it `mlp` in memory (stacked `experts.gate_up_proj` / `experts.down_proj`). Both load into
our `mlp`, a `SparseMoeBlock`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ksana_llm.layers.moe import FusedExperts, SparseMoeBlock
from ksana_llm.layers.moe_routers import SoftmaxTopKRouter
from ksana_llm.loader.quantized import input_scale_group
from ksana_llm.models.llama import MistralForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        num_experts = config.num_local_experts
        router = SoftmaxTopKRouter(config.hidden_size, num_experts, config.num_experts_per_tok,
                                   renormalize=True)
        experts = FusedExperts(num_experts, config.hidden_size, config.intermediate_size,
                               getattr(config, "hidden_act", "silu"), parallel=self.parallel,
                               scale_group=input_scale_group(config))
        return SparseMoeBlock(router, experts, parallel=self.parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        return super().load_weights(((name.replace(".block_sparse_moe.", ".mlp."), tensor)
                              for name, tensor in weights), require_all=require_all)
