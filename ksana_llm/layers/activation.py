"""Activations: gated (SwiGLU-style, over fused gate/up) and plain."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import torch
import torch.nn.functional as F

from ksana_llm.layers.fused_kernels import fused_kernels_on

_ACTIVATIONS = MappingProxyType({"silu": F.silu, "swish": F.silu, "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")})
# The activations the fused Triton kernel (`kernels.silu_and_mul`) computes.
_FUSED = frozenset({"silu", "swish"})


def get_gated_activation(name: str):
    """`act(gate) * up` over a fused [..., 2 * I] gate/up tensor."""
    try:
        act = _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(_ACTIVATIONS)}") from None
    fusable = name in _FUSED

    def gated(x: torch.Tensor) -> torch.Tensor:
        if fusable and fused_kernels_on():
            # One launch, no temporary: at small batches a decode step's time is mostly launches.
            from ksana_llm import kernels

            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return act(gate).mul_(up)  # in place on the fresh activation: one temporary fewer

    return gated


def get_activation(name: str):
    """The plain activation `name` (a non-gated MLP's: StarCoder 2's)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(_ACTIVATIONS)}") from None


def clamped_swiglu(alpha: float, limit: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """GPT-OSS's gated activation over a fused [..., 2 * I] tensor of [gate; up] halves: the gate
    clamped from above at `limit`, the up to [-limit, limit]; then
    gate * sigmoid(alpha * gate) * (up + 1). (The checkpoint interleaves gate and up columns;
    the loader de-interleaves them into halves, so this reads what every other MLP reads.)"""

    def gated(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)

    return gated
