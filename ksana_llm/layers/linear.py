"""Linear layers that know how to load checkpoint tensors, including fused (merged) ones."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Module):
    """One matmul for several projections stacked along the output dim (QKV, gate/up).

    Checkpoints store the parts separately; `load_shard` copies part `index` into its rows.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        total = sum(out_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, index: int) -> None:
        start, size = self.offsets[index], self.out_sizes[index]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {index} has {tensor.shape[0]} rows, expected {size}")
        param.data[start:start + size].copy_(tensor)
