"""Gated activations."""

from __future__ import annotations

from types import MappingProxyType

import torch
import torch.nn.functional as F

_ACTIVATIONS = MappingProxyType({"silu": F.silu, "swish": F.silu, "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")})


def get_gated_activation(name: str):
    """`act(gate) * up` over a fused [..., 2 * I] gate/up tensor."""
    try:
        act = _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(_ACTIVATIONS)}") from None

    def gated(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate).mul_(up)  # in place on the fresh activation: one temporary fewer

    return gated
