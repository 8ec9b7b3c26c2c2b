"""RMSNorm, optionally fused with the residual add that precedes it; RMSNorm over a projection
split across tensor-parallel ranks; LayerNorm without a bias (Cohere's), whole or per head."""

from __future__ import annotations

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.fused_kernels import fused_kernels_on
from ksana_llm.layers.parallel import tp_all_reduce


class RMSNorm(nn.Module):
    """`weight_in_float32`: multiply the weight in float32 before the cast back (transformers'
    OLMo 2 and GPT-OSS norms), rather than after it (Llama's); set by those families."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_in_float32 = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like transformers, then cast back before the weight multiply.
        xf = x.float()
        scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(self.eps))
        if self.weight_in_float32:
            return (self.weight.float() * (xf * scale)).to(x.dtype)
        return self.weight * (xf * scale).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if fused_kernels_on():
            # One fused kernel (add + norm) instead of the half-dozen elementwise launches
            # below, which dominate small-batch GPU decode.
            from ksana_llm import kernels

            return kernels.rms_norm(x, self.weight, self.eps, residual,
                                    weight_in_float32=self.weight_in_float32)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a whole projection whose columns are split over the tensor-parallel ranks
    (OLMo 2's q/k norms span every head): each rank keeps the weights of its columns
    `[start, start + size)` of `full_size`, and the mean of squares sums over all of them (one
    all-reduce of a [tokens, 1] tensor). `replicas`: how many ranks hold each column (KV heads
    replicated over more ranks than there are heads), which the all-reduce counts that often.
    The weight multiplies in float32, as transformers' OLMo 2 does."""

    def __init__(self, full_size: int, shard: tuple[int, int], eps: float,
                 parallel: ParallelContext, replicas: int = 1) -> None:
        super().__init__()
        self.full_size = full_size
        self.replicas = replicas
        self.start, size = shard
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.parallel.tp_size > 1:
            squares = tp_all_reduce(squares, self.parallel).div_(self.replicas)
        scale = torch.rsqrt(squares.div_(self.full_size).add_(self.eps))
        return (self.weight.float() * (xf * scale)).to(x.dtype)

    def expected_checkpoint_keys(self) -> list[str]:
        return ["weight"]

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        if name != "weight" or tuple(tensor.shape) != (self.full_size,):
            raise ValueError(f"norm {name!r}: shape {tuple(tensor.shape)}, expected "
                             f"[{self.full_size}]")
        self.weight.data.copy_(tensor[self.start:self.start + self.weight.shape[0]])
        return ["weight"]


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim without a bias, in float32, the weight multiplied before the
    cast back (transformers' Cohere)."""
    xf = x.float()
    normed = torch.nn.functional.layer_norm(xf, (xf.shape[-1],), eps=eps)
    return (weight.float() * normed).to(x.dtype)


class LayerNormNoBias(nn.Module):
    """Cohere's norm: mean-centred, scaled, no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _layer_norm(x, self.weight, self.eps)


class HeadwiseLayerNorm(nn.Module):
    """`LayerNormNoBias` over each head of q or k ([tokens, heads, head_dim]), every head with
    weights of its own (Cohere's q/k norms: a [heads, head_dim] checkpoint tensor); a
    tensor-parallel rank keeps the rows of its heads `[first, first + count)`."""

    def __init__(self, total_heads: int, shard: tuple[int, int], head_dim: int,
                 eps: float) -> None:
        super().__init__()
        self.total_heads = total_heads
        self.first, count = shard
        self.weight = nn.Parameter(torch.ones(count, head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _layer_norm(x, self.weight, self.eps)

    def expected_checkpoint_keys(self) -> list[str]:
        return ["weight"]

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        expected = (self.total_heads, self.weight.shape[1])
        if name != "weight" or tuple(tensor.shape) != expected:
            raise ValueError(f"norm {name!r}: shape {tuple(tensor.shape)}, expected "
                             f"{list(expected)}")
        self.weight.data.copy_(tensor[self.first:self.first + self.weight.shape[0]])
        return ["weight"]
