"""Mixture-of-experts: routers, stacked expert weights, and the MoE block that joins them.

A block is `router -> experts (+ optional shared expert)`; each part is a constructor argument, so
a family picks its own router (softmax top-k for Mixtral / Qwen MoE, group-limited sigmoid for
DeepSeek-V3) and its own shared-expert arrangement without a new block class.

Experts are stored stacked, `w13 [E, 2I, H]` (gate rows, then up rows) and `w2 [E, H, I]`, so the
forward runs one matmul pair per *active* expert over the tokens sorted by expert, never a loop
over tokens. `FusedExperts` loads both the per-expert tensors of hub checkpoints
(`experts.N.{w1,w3,w2}.weight` in Mixtral, `experts.N.{gate,up,down}_proj.weight` in Qwen /
DeepSeek) and the stacked tensors transformers 5 keeps in memory
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ksana_llm.layers.activation import get_gated_activation
from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.linear import MergedLinear
from ksana_llm.layers.parallel import SINGLE, RowParallelLinear, tp_all_reduce


class Routing(NamedTuple):
    """Each token's chosen experts and their combine weights (float32, like transformers)."""
    weights: torch.Tensor  # [T, K] float32
    experts: torch.Tensor  # [T, K] int64


class SoftmaxTopKRouter(nn.Module):
    """Softmax over all experts (in float32), keep the top k, optionally renormalise them to sum 1.

    Mixtral always renormalises; Qwen2-MoE / Qwen3-MoE follow `norm_topk_prob`. transformers'
    Qwen routers round the weights to the activation dtype before the combine
    (`weights_in_input_dtype=True`); Mixtral keeps them in float32.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, renormalize: bool,
                 weights_in_input_dtype: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_input_dtype = weights_in_input_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_input_dtype:
            weights = weights.to(x.dtype).float()
        return Routing(weights, experts)


class GroupedTopKRouter(nn.Module):
    """DeepSeek-V3's group-limited routing (`topk_method="noaux_tc"`).

    Sigmoid scores; `e_score_correction_bias` is added for *selection only*. Experts form `n_group`
    groups, each scored by the sum of its top-2 biased scores; only the best `topk_group` groups
    stay eligible, and the top k experts among them are picked. Their weights are the unbiased
    scores, optionally renormalised (`norm_topk_prob`), times `routed_scaling_factor`.

    Like transformers (`_keep_in_fp32_modules_strict`), the router weight and the bias stay in
    float32 whatever dtype the model is cast to: near-tied scores must pick the same experts in
    bf16 serving as in the fp32 reference.
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

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        super()._apply(fn, recurse)
        # Model.from_pretrained casts the whole model to the serving dtype; undo it here (see
        # the class docstring). Device moves and to_empty still apply.
        for param in (self.weight, self.e_score_correction_bias):
            if param.dtype != torch.float32:
                param.data = param.data.float()
        return self

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


# Per-expert checkpoint names: Mixtral's w1/w3/w2 and the gate/up/down_proj of Qwen / DeepSeek.
_PER_EXPERT = re.compile(r"(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight")
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}  # index into w13's [gate; up] halves


class FusedExperts(nn.Module):
    """`num_experts` gated MLPs stored stacked; forward over tokens sorted by expert.

    Under tensor parallelism every rank keeps every expert, each with a slice of its
    intermediate columns; the output is then a partial sum that the enclosing `SparseMoeBlock`
    all-reduces once."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 hidden_act: str = "silu", *, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.full_intermediate_size = intermediate_size
        self.shard_start, intermediate_size = parallel.tp_split(intermediate_size)
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                               requires_grad=False)
        self.act = get_gated_activation(hidden_act)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, H]; returns sum_k weight[t, k] * expert[experts[t, k]](x[t]) as [T, H]."""
        num_tokens, top_k = routing.experts.shape
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, k) assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        x_sorted = x.index_select(0, order // top_k)
        out_sorted = torch.empty_like(x_sorted)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            hidden = self.act(F.linear(x_sorted[rows], self.w13[expert]))
            out_sorted[rows] = F.linear(hidden, self.w2[expert])
            start += count
        # As transformers' default (grouped_mm) path: weight in float32 (the router's dtype),
        # restore (token, k) order, sum the k contributions in float32, cast once at the end.
        weighted = out_sorted * routing.weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.empty_like(weighted).index_copy_(0, order, weighted)
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)

    # ---- checkpoint loading (see models/weight_loading.py) -------------------------------------
    def expected_checkpoint_keys(self) -> list[str]:
        return [f"{e}.{part}" for e in range(self.num_experts) for part in ("gate", "up", "down")]

    def load_checkpoint_tensor(self, local_name: str, tensor: torch.Tensor) -> list[str]:
        """One per-expert tensor (`3.w1.weight`, `3.down_proj.weight`, ...) or a stacked one
        (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`); returns the keys it filled."""
        experts = range(self.num_experts)
        full, first, size = self.full_intermediate_size, self.shard_start, self.intermediate_size
        if local_name == "gate_up_proj":  # [E, 2I, H]: this rank's rows of each half
            gate, up = tensor[:, first:first + size], tensor[:, full + first:full + first + size]
            if tensor.shape[1] != 2 * full:
                gate = tensor  # wrong width: let the shape check below name it
            _copy_checked(self.w13.data, torch.cat([gate, up], dim=1) if gate is not tensor
                          else tensor, "experts.gate_up_proj")
            return [f"{e}.{part}" for e in experts for part in ("gate", "up")]
        if local_name == "down_proj":  # [E, H, I]: this rank's columns
            _copy_checked(self.w2.data, tensor[..., first:first + size] if tensor.shape[-1] == full
                          else tensor, "experts.down_proj")
            return [f"{e}.down" for e in experts]
        match = _PER_EXPERT.fullmatch(local_name)
        if match is None:
            raise ValueError(f"unexpected expert tensor {local_name!r}")
        expert, kind = int(match.group(1)), match.group(2)
        if expert >= self.num_experts:
            raise ValueError(f"expert tensor {local_name!r}: only {self.num_experts} experts")
        if kind in ("w2", "down_proj"):
            if tensor.shape[-1] == full:
                tensor = tensor[:, first:first + size]
            _copy_checked(self.w2.data[expert], tensor, local_name)
            return [f"{expert}.down"]
        part = _PART[kind]
        if tensor.shape[0] == full:
            tensor = tensor[first:first + size]
        _copy_checked(self.w13.data[expert, part * size:(part + 1) * size], tensor, local_name)
        return [f"{expert}.{('gate', 'up')[part]}"]


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class GatedMLP(nn.Module):
    """A dense gated MLP (`down(act(gate(x)) * up(x))`), named like HF checkpoints
    (`gate_proj` / `up_proj` load into `gate_up_proj` through the model's fused parts):
    Qwen2-MoE's `shared_expert`, DeepSeek's `shared_experts`, or a dense layer of a MoE model."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 bias: bool = False, *, parallel: ParallelContext = SINGLE,
                 reduce_output: bool = True) -> None:
        super().__init__()
        shard = parallel.tp_split(intermediate_size)
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size],
                                         bias=bias, shards=[shard, shard])
        # Inside a SparseMoeBlock the block all-reduces once for experts and shared expert.
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           ctx=parallel, reduce_output=reduce_output)
        self.act = get_gated_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """`experts(x, router(x))`, plus an optional shared expert, itself optionally scaled by
    `sigmoid(shared_expert_gate(x))` (Qwen2-MoE; DeepSeek adds its shared experts ungated).

    Submodule names are the checkpoint's: `gate`, `experts`, and the shared expert under
    `shared_expert_name` (`shared_expert` for Qwen2-MoE, `shared_experts` for DeepSeek), with its
    gate as `shared_expert_gate`.
    """

    def __init__(self, router: nn.Module, experts: FusedExperts,
                 shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, *,
                 shared_expert_name: str = "shared_expert",
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel  # experts (and a shared expert built with reduce_output=False)
        # return partial sums under tensor parallelism: one all-reduce here covers them all
        if shared_expert_gate is not None and shared_expert is None:
            raise ValueError("shared_expert_gate needs a shared_expert")
        self.gate = router
        self.experts = experts
        self.shared_expert_name = shared_expert_name
        if shared_expert is not None:
            self.add_module(shared_expert_name, shared_expert)
        self.shared_expert_gate = shared_expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        out = self.experts(x, self.gate(x))
        shared = self._modules.get(self.shared_expert_name)
        if shared is not None:
            extra = shared(x)
            if self.shared_expert_gate is not None:
                extra = torch.sigmoid(self.shared_expert_gate(x)) * extra
            out = out + extra
        return tp_all_reduce(out, self.parallel).reshape(shape)
