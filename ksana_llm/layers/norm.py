"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from ksana_llm.layers.fused_kernels import fused_kernels_on


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like transformers, then cast back before the weight multiply.
        xf = x.float()
        scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(self.eps))
        return self.weight * (xf * scale).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if fused_kernels_on():
            # One fused kernel (add + norm) instead of the half-dozen elementwise launches
            # below, which dominate small-batch GPU decode.
            from ksana_llm import kernels

            return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
