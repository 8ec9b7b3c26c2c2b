"""Checkpoint loading for `layers.moe.FusedExperts` (see models/weight_loading.py): per-expert
tensors of hub checkpoints (`experts.N.{w1,w3,w2}.weight` in Mixtral,
`experts.N.{gate,up,down}_proj.weight` in Qwen / DeepSeek / GPT-OSS once rearranged), the stacked
ones transformers 5 keeps in memory (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj
[E, H, I]`), stacked biases (GPT-OSS), and quantized experts kept quantized where they agree."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ksana_llm.loader.quantized_weight import (QuantizedLayout, QuantizedWeight, dense,
                                               in_input_order, quantize_on_load)
from ksana_llm.loader.weight_quant import PACKED_INT4_DTYPE, dequantize_weight

# Per-expert checkpoint names: Mixtral's w1/w3/w2 and the gate/up/down_proj of Qwen / DeepSeek.
_PER_EXPERT = re.compile(r"(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight")
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}  # index into w13's [gate; up] halves


class ExpertLoading:
    """Mixed into `FusedExperts`, which holds the stacks, their quantization buffers and the
    tensor-parallel slice these fill."""

    num_experts: int
    hidden_size: int
    full_intermediate_size: int
    intermediate_size: int
    shard_start: int
    w13: nn.Parameter
    w2: nn.Parameter
    w13_bias: nn.Parameter | None
    w2_bias: nn.Parameter | None
    group_sizes: dict[str, int]
    int8_activations: dict[str, bool]
    fp4: dict[str, bool]
    online_quantization: str | None
    quantized_capable: bool
    _ordered: dict[str, set[int]]
    _has_dense: dict[str, bool]
    _dense_dtype: torch.dtype
    register_buffer: Any

    def expected_checkpoint_keys(self) -> list[str]:
        keys = [f"{e}.{part}" for e in range(self.num_experts) for part in ("gate", "up", "down")]
        return keys + (["gate_up_proj_bias", "down_proj_bias"] if self.w13_bias is not None
                       else [])

    def load_checkpoint_tensor(self, local_name: str, tensor: torch.Tensor | QuantizedWeight
                               ) -> list[str]:
        """One per-expert tensor (`3.w1.weight`, `3.down_proj.weight`, ...) or a stacked one
        (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`); returns the keys it filled."""
        full = self.full_intermediate_size
        if local_name in ("gate_up_proj_bias", "down_proj_bias") and self.w13_bias is not None:
            return self._load_bias(local_name, dense(tensor))
        if local_name in ("gate_up_proj", "down_proj"):  # stacked: expert by expert
            stacked = dense(tensor)
            if stacked.dim() != 3 or stacked.shape[0] != self.num_experts:
                raise ValueError(f"experts.{local_name}: shape {tuple(stacked.shape)}, expected "
                                 f"{self.num_experts} experts")
            keys = []
            for expert, weights in enumerate(stacked):
                if local_name == "down_proj":
                    keys += self._load_expert(expert, "down", weights, f"experts.{local_name}")
                else:
                    if weights.shape[0] != 2 * full:
                        raise ValueError(f"experts.{local_name}: shape {tuple(stacked.shape)}, "
                                         f"expected {2 * full} gate and up rows per expert")
                    keys += self._load_expert(expert, "gate", weights[:full], local_name)
                    keys += self._load_expert(expert, "up", weights[full:], local_name)
            return keys
        match = _PER_EXPERT.fullmatch(local_name)
        if match is None:
            raise ValueError(f"unexpected expert tensor {local_name!r}")
        expert, kind = int(match.group(1)), match.group(2)
        if expert >= self.num_experts:
            raise ValueError(f"expert tensor {local_name!r}: only {self.num_experts} experts")
        part = "down" if kind in ("w2", "down_proj") else ("gate", "up")[_PART[kind]]
        return self._load_expert(expert, part, tensor, local_name)

    def _load_bias(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Every expert's biases, stacked: `gate_up_proj_bias` [E, 2I] (gate half, then up)
        or `down_proj_bias` [E, H]."""
        full = self.full_intermediate_size
        rows = 2 * full if name == "gate_up_proj_bias" else self.hidden_size
        if tuple(tensor.shape) != (self.num_experts, rows):
            raise ValueError(f"experts.{name}: shape {tuple(tensor.shape)}, expected "
                             f"{(self.num_experts, rows)}")
        if name == "down_proj_bias":
            self.w2_bias.data.copy_(tensor)
        else:  # this rank's rows of each half
            first, size = self.shard_start, self.intermediate_size
            self.w13_bias.data.copy_(torch.cat([tensor[:, first:first + size],
                                                tensor[:, full + first:full + first + size]], 1))
        return [name]

    def _load_expert(self, expert: int, part: str, tensor: torch.Tensor | QuantizedWeight,
                     name: str) -> list[str]:
        """Expert `expert`'s `part` (gate / up: [I, H]; down: [H, I]), full or this rank's
        slice, into w13 / w2."""
        if len(tensor.shape) != 2:  # a scalar or a stray dim: name it, do not index past it
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected a 2-d tensor")
        method = self._quantizes_dense("w2" if part == "down" else "w13")
        if isinstance(tensor, torch.Tensor) and method is not None:
            # Whole rows, then this rank's slice: every rank has the scales one rank would.
            tensor = quantize_on_load(tensor, method)
        first, size = self.shard_start, self.intermediate_size
        full = self.full_intermediate_size
        if part == "down":
            if tensor.shape[-1] == full and size != full:  # this rank's input columns
                tensor = tensor.columns(first, size) if isinstance(tensor, QuantizedWeight) \
                    else tensor[:, first:first + size]
            target, rows = "w2", slice(0, self.w2.shape[1])
        else:
            if tensor.shape[0] == full and size != full:  # this rank's rows
                tensor = tensor.rows(first, size) if isinstance(tensor, QuantizedWeight) \
                    else tensor[first:first + size]
            index = 0 if part == "gate" else 1
            target, rows = "w13", slice(index * size, (index + 1) * size)
        inputs = self.hidden_size if target == "w13" else self.intermediate_size
        expected = (rows.stop - rows.start, inputs)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {expected}")
        tensor = self._incoming(target, tensor, expert)
        if isinstance(tensor, QuantizedWeight):
            getattr(self, target).data[expert, rows].copy_(tensor.data)
            getattr(self, f"{target}_scale")[expert, rows].copy_(tensor.scale)
            if tensor.zero_point is not None:
                getattr(self, f"{target}_zero_point")[expert, rows].copy_(tensor.zero_point)
        else:
            getattr(self, target).data[expert, rows].copy_(tensor)
        return [f"{expert}.{part}"]

    def _quantizes_dense(self, target: str) -> str | None:
        """How a dense tensor for `target` is quantized as it loads: to MXFP4 while the stack
        holds MXFP4 (a trainer's bf16 weight update keeps the model's format rather than being
        refused), else by the online quantization asked for; None: kept as it is."""
        if not self.quantized_capable:
            return None
        if self.fp4[target] and not self._has_dense[target]:
            return "mxfp4"
        return self.online_quantization

    def _incoming(self, target: str, tensor: torch.Tensor | QuantizedWeight, expert: int
                  ) -> torch.Tensor | QuantizedWeight:
        """`tensor` in the form `target` stores: quantized (switching storage on the first
        one), or dense, dequantizing every quantized expert already stored when the tensors
        disagree (FP8 and int8 ones, other scale layouts, with and without zero points or
        activation order, or an expert's gate and up in different input orders)."""
        scale = getattr(self, f"{target}_scale")
        if isinstance(tensor, QuantizedWeight) and self.quantized_capable \
                and not self._has_dense[target]:
            ordered = tensor.input_order is not None
            if scale is None:
                self._store_quantized(target, tensor.layout, ordered)
                scale = getattr(self, f"{target}_scale")
            stored = QuantizedLayout.of(getattr(self, target), scale.shape[2],
                                        self.group_sizes[target],
                                        getattr(self, f"{target}_zero_point"),
                                        self.int8_activations[target], self.fp4[target])
            stored_ordered = getattr(self, f"{target}_input_order") is not None
            if (tensor.layout, ordered) == (stored, stored_ordered) \
                    and self._same_input_order(target, expert, tensor.input_order):
                return tensor
        if isinstance(tensor, QuantizedWeight):
            tensor = tensor.dequantize()
        self._has_dense[target] = True
        if scale is not None:  # rows stored quantized so far become dense
            weight = getattr(self, target).data
            zero = getattr(self, f"{target}_zero_point")
            order = getattr(self, f"{target}_input_order")
            dense_weight = torch.stack([in_input_order(
                dequantize_weight(weight[e], scale[e], self.group_sizes[target], self._dense_dtype,
                                  None if zero is None else zero[e], self.fp4[target]),
                None if order is None else order[e]) for e in range(self.num_experts)])
            setattr(self, target, nn.Parameter(dense_weight, requires_grad=False))
            for buffer in ("scale", "zero_point", "input_order"):
                setattr(self, f"{target}_{buffer}", None)
            self.int8_activations[target] = self.fp4[target] = False
        return tensor

    def _same_input_order(self, target: str, expert: int, order: torch.Tensor | None) -> bool:
        """Whether `order` agrees with what expert `expert` of `target` already takes (its
        gate's, when the up arrives), recording it for the expert's first part."""
        if order is None:
            return True
        stored = getattr(self, f"{target}_input_order")
        if expert in self._ordered[target]:
            return bool(torch.equal(stored[expert].cpu(), order.cpu()))
        stored[expert].copy_(order)
        self._ordered[target].add(expert)
        return True

    def _store_quantized(self, target: str, layout: QuantizedLayout, ordered: bool) -> None:
        param = getattr(self, target)
        self._dense_dtype = param.dtype
        experts, rows, columns = param.shape
        if ordered:  # each expert's order set as its first part loads
            self.register_buffer(f"{target}_input_order",
                                 torch.arange(columns, device=param.device).repeat(experts, 1),
                                 persistent=False)
        if layout.dtype == PACKED_INT4_DTYPE:  # two codes a byte (integers or FP4)
            columns //= 2
        if layout.zero_dtype is not None:
            self.register_buffer(f"{target}_zero_point",
                                 torch.zeros(experts, rows, layout.groups,
                                             dtype=layout.zero_dtype, device=param.device),
                                 persistent=False)
        setattr(self, target, nn.Parameter(
            torch.empty(experts, rows, columns, dtype=layout.dtype, device=param.device),
            requires_grad=False))
        self.register_buffer(f"{target}_scale",
                             torch.full((experts, rows, layout.groups), layout.unit_scale,
                                        dtype=layout.scale_dtype, device=param.device),
                             persistent=False)
        self.group_sizes[target] = layout.group_size
        self.int8_activations[target] = layout.int8_activations
        self.fp4[target] = layout.fp4
