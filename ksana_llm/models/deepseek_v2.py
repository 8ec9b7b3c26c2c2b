"""DeepSeek-V2 family (V2, V2-Lite, V2.5, Coder-V2): DeepSeek-V3's layout with V2's routing.

What V2 shares with `models/deepseek_v3.py`: multi-head latent attention over a one-latent paged
cache (a full-rank `q_proj` when `q_lora_rank` is null, as in V2-Lite), YaRN RoPE on
`qk_rope_head_dim` with DeepSeek's softmax scale, `first_k_dense_replace` dense layers, then
MoE layers with `n_shared_experts` always-on experts; tensor and pipeline parallelism split them
the same way. What differs:

- routing: softmax over the experts, top k over all of them (`topk_method="greedy"`) or within
  the best `topk_group` groups (`"group_limited_greedy"`, V2 / V2.5), no selection bias
  (`layers.moe_routers.GroupLimitedSoftmaxRouter`);
- RoPE always pairs adjacent dims (V2's configs carry no `rope_interleave`);
- no multi-token-prediction layers.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ksana_llm.layers.moe_routers import GroupLimitedSoftmaxRouter
from ksana_llm.models.deepseek_v3 import DeepseekV3ForCausalLM

_TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    @staticmethod
    def check_routing(config: Any) -> None:
        method = getattr(config, "topk_method", "greedy")
        if method not in _TOPK_METHODS:
            raise ValueError(f"topk_method={method!r} is not supported for DeepSeek-V2 "
                             f"(supported: {', '.join(_TOPK_METHODS)})")
        scoring = getattr(config, "scoring_func", "softmax")
        if scoring != "softmax":
            raise ValueError(f"scoring_func={scoring!r} is not supported (DeepSeek-V2 uses "
                             "'softmax')")

    def make_router(self, config: Any) -> nn.Module:
        return GroupLimitedSoftmaxRouter(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
            n_group=config.n_group or 1, topk_group=config.topk_group or 1,
            group_limited=getattr(config, "topk_method", "greedy") == "group_limited_greedy",
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0))

    def interleaved_rope(self, config: Any) -> bool:
        return True
