"""Rotary position embedding (NeoX / Llama "rotate half" layout) with Llama-3 and linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_settings(config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from a HF config, transformers 4.x or 5.x style."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {}) or params
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return float(theta), scaling


def partial_rotary_dim(config: Any, head_dim: int, default: float = 1.0) -> int:
    """How many of a head's dims RoPE rotates: `partial_rotary_factor` (in the config or its rope
    parameters; `default` when neither gives it) of `head_dim`."""
    _, scaling = rope_settings(config)
    factor = scaling.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    factor = default if factor is None else float(factor)
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives a rotary dim of {rotary_dim}; "
                         "it must be even and at least 2")
    return rotary_dim


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, short kept,
    the band between interpolated."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    # Always on the CPU, even when the model is being built on the meta device.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", "dynamic"):
        # Dynamic NTK scaling changes the base only past max_position_embeddings, which bounds
        # max_model_len: within it, transformers' tables are the default ones.
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, dynamic, "
                     "linear, llama3, yarn, longrope")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given absolute positions; the cos/sin table is built lazily on the
    device of first use (so the module can be created on the meta device)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.inv_freq = compute_inv_freq(head_dim, theta, scaling or {})
        # YaRN scales the table (in float32, before the cast, as transformers does); 1 elsewhere.
        self.attention_factor = 1.0
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def _angles(self) -> torch.Tensor:
        """The table's rotation angles, [rows, D/2] float32; row p is position p here."""
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        return torch.outer(t, self.inv_freq)

    def _table(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._cos_sin
        if cached is None or cached[0].device != device or cached[0].dtype != dtype:
            angles = self._angles()
            cached = ((angles.cos() * self.attention_factor).to(device, dtype),
                      (angles.sin() * self.attention_factor).to(device, dtype))
            self._cos_sin = cached
        return cached

    def _rows(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The table's cos and sin at `rows`, shaped [T, 1, D/2]."""
        cos_table, sin_table = self._table(rows.device, dtype)
        return cos_table.index_select(0, rows).unsqueeze(1), \
            sin_table.index_select(0, rows).unsqueeze(1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                long_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions`, shaped [T, 1, D/2]; computed once per step, shared by
        every layer. `long_rows` ([T] bool) picks LongRoPE's long factors
        (layers.rotary_longrope); a table with one set of frequencies has nothing to pick."""
        return self._rows(positions, dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the head dim (NeoX / Llama layout); with a table narrower than
    the head (partial rotary: GLM), its first 2 * cos.shape[-1] dims, the rest passed through."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]),
                         dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
