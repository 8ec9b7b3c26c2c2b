"""MoE routers: from a token's hidden state to its k experts and their combine weights.

`SoftmaxTopKRouter` (Mixtral, Qwen MoE), `GroupedTopKRouter` (DeepSeek-V3's group-limited
sigmoid routing) and `GroupLimitedSoftmaxRouter` (DeepSeek-V2's) all return a `Routing`, which
`layers.moe.FusedExperts` consumes. None reads anything back to the host, so a decode step that
routes can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Routing(NamedTuple):
    """Each token's chosen experts and their combine weights (float32, like transformers)."""
    weights: torch.Tensor  # [T, K] float32
    experts: torch.Tensor  # [T, K] int64


class SoftmaxTopKRouter(nn.Module):
    """Softmax over all experts (in float32), keep the top k, optionally renormalise them to sum 1.

    Mixtral always renormalises; Qwen2-MoE / Qwen3-MoE follow `norm_topk_prob`. transformers'
    Qwen routers round the weights to the activation dtype before the combine
    (`weights_in_input_dtype=True`); Mixtral keeps them in float32. GPT-OSS's router has a
    `bias` and takes the softmax of the top k logits, which is the renormalised top k of the
    softmax over all.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, renormalize: bool,
                 weights_in_input_dtype: bool = False, bias: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_input_dtype = weights_in_input_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias
                     else None)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight, self.bias)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_input_dtype:
            weights = weights.to(x.dtype).float()
        return Routing(weights, experts)


class _Float32Router(nn.Module):
    """A router whose parameters stay in float32 whatever dtype the model is cast to, like
    transformers' DeepSeek routers (`_keep_in_fp32_modules_strict`): near-tied scores must pick
    the same experts in bf16 serving as in the fp32 reference."""

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        super()._apply(fn, recurse)
        # Model.from_pretrained casts the whole model to the serving dtype; undo it here. Device
        # moves and to_empty still apply.
        for param in self.parameters(recurse=False):
            if param.dtype != torch.float32:
                param.data = param.data.float()
        return self


class GroupedTopKRouter(_Float32Router):
    """DeepSeek-V3's group-limited routing (`topk_method="noaux_tc"`).

    Sigmoid scores; `e_score_correction_bias` is added for *selection only*. Experts form `n_group`
    groups, each scored by the sum of its top-2 biased scores; only the best `topk_group` groups
    stay eligible, and the top k experts among them are picked. Their weights are the unbiased
    scores, optionally renormalised (`norm_topk_prob`), times `routed_scaling_factor`. The
    router weight and the bias stay in float32 (see `_Float32Router`).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, n_group: int,
                 topk_group: int, renormalize: bool, routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group must divide n_routed_experts ({num_experts}), got {n_group}")
        if num_experts // n_group < 2:
            raise ValueError("each expert group needs at least 2 experts (groups are scored by "
                             f"their top-2), got n_routed_experts={num_experts}, n_group={n_group}")
        if not 0 < topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
        if not 0 < top_k <= topk_group * (num_experts // n_group):
            raise ValueError(f"num_experts_per_tok={top_k} exceeds the experts of topk_group "
                             f"groups ({topk_group * (num_experts // n_group)})")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.renormalize = renormalize
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> Routing:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias
        num_tokens, num_experts = biased.shape
        grouped = biased.view(num_tokens, self.n_group, num_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, best_groups, True)
        eligible = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        experts = biased.masked_fill(~eligible, float("-inf")).topk(self.top_k, dim=-1,
                                                                    sorted=False).indices
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights * self.routed_scaling_factor, experts)


class GroupLimitedSoftmaxRouter(_Float32Router):
    """DeepSeek-V2's routing (V2, V2-Lite, V2.5, Coder-V2): softmax over all experts in float32,
    then the top k, either over every expert (`topk_method="greedy"`) or only within the best
    `topk_group` of `n_group` groups, each group scored by its highest probability
    (`"group_limited_greedy"`). The weights are the probabilities, renormalised when
    `norm_topk_prob`, times `routed_scaling_factor`, as vLLM computes them (DeepSeek's own code
    skips the factor when it renormalises; transformers' port ignores the flag; no published
    V2 checkpoint sets it). No selection bias. The router weight stays in float32 (see
    `_Float32Router`).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, n_group: int = 1,
                 topk_group: int = 1, group_limited: bool, renormalize: bool,
                 routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        if group_limited:
            if n_group < 1 or num_experts % n_group:
                raise ValueError(f"n_group must divide n_routed_experts ({num_experts}), "
                                 f"got {n_group}")
            if not 0 < topk_group <= n_group:
                raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
            eligible = topk_group * (num_experts // n_group)
        else:
            n_group, topk_group, eligible = 1, 1, num_experts
        if not 0 < top_k <= eligible:
            raise ValueError(f"num_experts_per_tok must be in [1, {eligible}], got {top_k}")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.group_limited = group_limited
        self.renormalize = renormalize
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> Routing:
        probs = torch.softmax(F.linear(x.float(), self.weight.float()), dim=-1)
        candidates = probs
        if self.group_limited and self.topk_group < self.n_group:
            num_tokens, num_experts = probs.shape
            grouped = probs.view(num_tokens, self.n_group, num_experts // self.n_group)
            best_groups = grouped.amax(dim=-1).topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros(num_tokens, self.n_group, dtype=torch.bool, device=x.device)
            group_mask.scatter_(1, best_groups, True)
            eligible = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
            # Probabilities are positive, so a zero never outranks an eligible expert (as
            # DeepSeek's code masks them).
            candidates = probs.masked_fill(~eligible, 0.0)
        weights, experts = candidates.topk(self.top_k, dim=-1, sorted=False)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights * self.routed_scaling_factor, experts)
