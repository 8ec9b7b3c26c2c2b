"""Mixture-of-experts: stacked expert weights, and the MoE block that joins them to a router.

A block is `router -> experts (+ optional shared expert)`; each part is a constructor argument, so
a family picks its own router (`layers.moe_routers`: softmax top-k for Mixtral / Qwen MoE,
group-limited sigmoid for DeepSeek-V3) and its own shared-expert arrangement without a new block
class.

Experts are stored stacked, `w13 [E, 2I, H]` (gate rows, then up rows) and `w2 [E, H, I]`, so the
forward runs one matmul pair per *active* expert over the tokens sorted by expert, never a loop
over tokens -- or, on the Triton backend, every expert in one launch per stack
(`kernels/fused_moe.py`), with nothing read back to the host, so CUDA graphs can capture it.
`FusedExperts` loads (`layers.moe_loading`) both the per-expert tensors of hub checkpoints
(`experts.N.{w1,w3,w2}.weight` in Mixtral, `experts.N.{gate,up,down}_proj.weight` in Qwen /
DeepSeek) and the stacked tensors transformers 5 keeps in memory
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ksana_llm.layers.activation import get_gated_activation
from ksana_llm.layers.fused_kernels import fused_kernels_on
from ksana_llm.layers.int8_activations import dequantize_tokens, quantize_tokens
from ksana_llm.layers.moe_loading import ExpertLoading
from ksana_llm.layers.moe_routers import Routing
from ksana_llm.distributed.context import ParallelContext
from ksana_llm.loader.weight_quant import PACKED_INT4_DTYPE, dequantize_weight
from ksana_llm.layers.linear import MergedLinear, fp8_kernel_for, quantized_matmul
from ksana_llm.layers.parallel import (SINGLE, RowParallelLinear, scale_aligned_split,
                                       tp_all_reduce, token_absmax_over_ranks)


class FusedExperts(ExpertLoading, nn.Module):
    """`num_experts` gated MLPs stored stacked; forward over tokens sorted by expert.

    Under tensor parallelism every rank keeps every expert, each with a slice of its
    intermediate columns (split as `layers.parallel.scale_aligned_split` says, given the
    checkpoint's scale blocks along them, `scale_group`); the output is then a partial sum that
    the enclosing `SparseMoeBlock` all-reduces once.

    Quantized experts (an FP8 checkpoint's, `online_quantization` for online quantization, an
    integer checkpoint's codes: int8, or 4-bit packed two a byte, or an MXFP4 checkpoint's e2m1
    codes, packed alike (`fp4`); with `w13_zero_point` / `w2_zero_point` beside the scales
    where the codes have zero points, and per-expert input orders in GPTQ's activation order)
    stay so (an MXFP4 stack quantizes dense tensors that arrive later, a weight update's, to
    MXFP4 as they load): `w13` / `w2` hold the quantized values and
    `w13_scale` [E, 2I, groups] / `w2_scale` [E, H, groups] their row-and-group scales
    (float32; MXFP4's E8M0 bytes: see `loader.quantized_weight`); each active expert's matmul
    takes its quantized weight as the projections do -- W8A8 experts quantizing their inputs
    to int8 per token first (under tensor parallelism a token's scale for `w2` comes from its
    whole intermediate row, over every rank's slice). Experts whose checkpoint tensors disagree
    (some quantized, some not, FP8 and int8, or other scale blocks) are all kept dense.

    `bias` (GPT-OSS): each expert's projections add a bias, `w13_bias` [E, 2I] (this rank's gate
    and up rows) and `w2_bias` [E, H] (added by the first tensor-parallel rank only: the ranks'
    outputs are summed). `activation` replaces `hidden_act`'s gated activation over the
    [gate; up] halves (GPT-OSS's `clamped_swiglu`)."""

    # The weight loader hands it quantized checkpoint weights as they are.
    takes_quantized_weights = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 hidden_act: str = "silu", *, parallel: ParallelContext = SINGLE,
                 bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 scale_group: int = 1) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        self.shard_start, intermediate_size = scale_aligned_split(intermediate_size, parallel,
                                                                  scale_group)
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                               requires_grad=False)
        self.act = activation or get_gated_activation(hidden_act)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.w13_scale: torch.Tensor | None
        self.w2_scale: torch.Tensor | None
        self.register_buffer("w13_scale", None, persistent=False)
        self.register_buffer("w2_scale", None, persistent=False)
        # zero points of packed 4-bit / asymmetric int8 codes, [E, rows, groups] like the scales
        self.w13_zero_point: torch.Tensor | None
        self.w2_zero_point: torch.Tensor | None
        self.register_buffer("w13_zero_point", None, persistent=False)
        self.register_buffer("w2_zero_point", None, persistent=False)
        # GPTQ's activation order, [E, inputs]: expert e's columns take x[..., order[e]] (gate
        # and up share one: GPTQ derives it from their common input)
        self.w13_input_order: torch.Tensor | None
        self.w2_input_order: torch.Tensor | None
        self.register_buffer("w13_input_order", None, persistent=False)
        self.register_buffer("w2_input_order", None, persistent=False)
        self._ordered: dict[str, set[int]] = {"w13": set(), "w2": set()}  # experts with theirs
        self.group_sizes = {"w13": 0, "w2": 0}
        self.int8_activations = {"w13": False, "w2": False}  # see QuantizedWeight
        self.fp4 = {"w13": False, "w2": False}  # packed codes are e2m1 (MXFP4): QuantizedWeight
        self.quantized_capable = True
        # "fp8" / "w8a8_int8": full-precision tensors quantized per row as they load
        self.online_quantization: str | None = None
        self._has_dense = {"w13": False, "w2": False}
        self._dense_dtype = torch.float32
        self._fp8_kernels: dict[str, Callable[..., torch.Tensor] | bool] = {}

    def syncs_with_host(self, fused_kernels: bool) -> bool:
        """Whether the forward reads routing back to the host (then no CUDA graphs), with or
        without the fused kernels (`layers.fused_kernels`, the Triton backend): the per-expert
        torch path does; the grouped Triton path, two launches with no host read, does not
        (see `_grouped_takes`)."""
        return not (fused_kernels and self._grouped_takes("w13") and self._grouped_takes("w2"))

    def _grouped_takes(self, name: str) -> bool:
        """Whether the grouped matmul takes this stack: dense, or quantized in groups its tiles
        divide (every checkpoint's so far: 32, 64, 128, or per row)."""
        scale = getattr(self, f"{name}_scale")
        if scale is None:
            return True
        from ksana_llm.kernels.fused_moe import grouped_block_k  # fused kernels: triton is here

        return grouped_block_k(getattr(self, name).dtype, self.group_sizes[name],
                               scale.shape[2] == 1) is not None

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, H]; returns sum_k weight[t, k] * expert[experts[t, k]](x[t]) as [T, H]."""
        if not self.syncs_with_host(fused_kernels_on()):
            return self._grouped_forward(x, routing)
        num_tokens, top_k = routing.experts.shape
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, k) assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        x_sorted = x.index_select(0, order // top_k)
        out_sorted = torch.empty_like(x_sorted)
        ends = list(itertools.accumulate(counts))
        active = [(e, slice(end - n, end)) for e, (n, end) in enumerate(zip(counts, ends)) if n]
        if self.int8_activations["w2"] and self.parallel.tp_size > 1:
            # Every hidden row first: each rank holds a slice of it, and the int8 scales need
            # the whole row's largest magnitude (one all-reduce for all of them).
            hidden = x_sorted.new_empty(x_sorted.shape[0], self.intermediate_size)
            for expert, rows in active:
                hidden[rows] = self.act(self._biased_matmul(x_sorted[rows], "w13", expert))
            absmax = token_absmax_over_ranks(hidden, self.parallel)
            for expert, rows in active:
                out_sorted[rows] = self._biased_matmul(hidden[rows], "w2", expert, absmax[rows])
        else:
            for expert, rows in active:
                hidden_rows = self.act(self._biased_matmul(x_sorted[rows], "w13", expert))
                out_sorted[rows] = self._biased_matmul(hidden_rows, "w2", expert)
        # As transformers' default (grouped_mm) path: weight in float32 (the router's dtype),
        # restore (token, k) order, sum the k contributions in float32, cast once at the end.
        weighted = out_sorted * routing.weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.empty_like(weighted).index_copy_(0, order, weighted)
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)

    def _grouped_forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The same sum with every expert in one launch per stack: rows stay in (token, k)
        order, and each expert's output is rounded to x's dtype before the float32 combine, as
        in the per-expert path."""
        from ksana_llm.kernels import align_to_experts, expert_block_size, expert_matmul

        num_tokens, top_k = routing.experts.shape
        if num_tokens == 0:
            return x.new_zeros(0, self.hidden_size)
        block_m = expert_block_size(num_tokens * top_k, self.num_experts)
        blocks = align_to_experts(routing.experts, self.num_experts, block_m)

        def stack(a: torch.Tensor, name: str, rows_per_input: int) -> torch.Tensor:
            if self.int8_activations[name]:
                # W8A8: the numbers the per-expert path multiplies (on a GPU it, too, takes the
                # int8 codes back to the activations' dtype); a token's scale does not depend
                # on its expert. Under tensor parallelism w2's rows are slices of each
                # assignment's hidden row: the scales come from the whole row.
                absmax = token_absmax_over_ranks(a, self.parallel) if name == "w2" else None
                a = dequantize_tokens(*quantize_tokens(a, absmax), a.dtype)
            return expert_matmul(a, getattr(self, name), blocks, rows_per_input,
                                 getattr(self, f"{name}_scale"), self.group_sizes[name],
                                 getattr(self, f"{name}_zero_point"),
                                 getattr(self, f"{name}_input_order"), fp4=self.fp4[name])

        assignments = routing.experts.reshape(-1)  # the stacks' rows are in (token, k) order
        hidden = self.act(self._add_bias(stack(x.contiguous(), "w13", top_k), "w13",
                                         assignments))
        out = self._add_bias(stack(hidden, "w2", 1), "w2", assignments)
        out = out.view(num_tokens, top_k, -1)
        return (out * routing.weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    def _add_bias(self, out: torch.Tensor, name: str, experts: int | torch.Tensor
                  ) -> torch.Tensor:
        """`out` plus the bias of `name` for each row's expert (`experts`: one for all rows, or
        one per row); unchanged without biases, and for `w2` on all but the first
        tensor-parallel rank (the ranks' outputs are summed: the bias must count once)."""
        bias = getattr(self, f"{name}_bias")
        if bias is None or (name == "w2" and self.parallel.tp_rank != 0):
            return out
        return out + bias[experts]

    def _biased_matmul(self, x: torch.Tensor, name: str, expert: int,
                       token_absmax: torch.Tensor | None = None) -> torch.Tensor:
        return self._add_bias(self._expert_matmul(x, name, expert, token_absmax), name, expert)

    def _expert_matmul(self, x: torch.Tensor, name: str, expert: int,
                       token_absmax: torch.Tensor | None = None) -> torch.Tensor:
        weight, scale = getattr(self, name), getattr(self, f"{name}_scale")
        if scale is None:
            return F.linear(x, weight[expert])
        group = self.group_sizes[name]
        if self.fp4[name]:  # no per-expert FP4 kernel: this expert's values, then the matmul
            return F.linear(x, dequantize_weight(weight[expert], scale[expert], group, x.dtype,
                                                 fp4=True))
        zero = getattr(self, f"{name}_zero_point")
        input_order = getattr(self, f"{name}_input_order")
        if input_order is not None:
            x = x.index_select(-1, input_order[expert])
        if name not in self._fp8_kernels and x.is_cuda:  # decided once per weight
            self._fp8_kernels[name] = fp8_kernel_for(group, scale.shape[2] == 1,
                                                     weight.dtype == PACKED_INT4_DTYPE) or False
        return quantized_matmul(x, weight[expert], scale[expert], group, None,
                                self._fp8_kernels.get(name) or None,
                                None if zero is None else zero[expert],
                                self.int8_activations[name], token_absmax)


class GatedMLP(nn.Module):
    """A dense gated MLP (`down(act(gate(x)) * up(x))`), named like HF checkpoints
    (`gate_proj` / `up_proj` load into `gate_up_proj` through the model's fused parts):
    Qwen2-MoE's `shared_expert`, DeepSeek's `shared_experts`, or a dense layer of a MoE model."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 bias: bool = False, *, parallel: ParallelContext = SINGLE,
                 reduce_output: bool = True, scale_group: int = 1) -> None:
        """`scale_group`: the checkpoint's scale blocks along the intermediate columns, which
        the tensor-parallel split takes into account (`layers.parallel.scale_aligned_split`)."""
        super().__init__()
        shard = scale_aligned_split(intermediate_size, parallel, scale_group)
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size],
                                         bias=bias, shards=[shard, shard])
        # Inside a SparseMoeBlock the block all-reduces once for experts and shared expert.
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           ctx=parallel, reduce_output=reduce_output,
                                           in_shard=shard)
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
