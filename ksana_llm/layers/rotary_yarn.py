"""YaRN rotary scaling (DeepSeek-V2/V3, Qwen long-context configs), as transformers computes it.

YaRN changes three things: the inverse frequencies (long wavelengths interpolated by `factor`,
short ones kept, a linear ramp between), a magnitude `attention_factor` that multiplies cos and
sin, and — for DeepSeek's MLA only — the softmax scale, multiplied by mscale(factor,
mscale_all_dim)^2. Each function mirrors `transformers.modeling_rope_utils._compute_yarn_parameters`
and `modeling_deepseek_v3.yarn_apply_mscale` line for line, so long-context models see the same
positions as the reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ksana_llm.layers.rotary import RotaryEmbedding
from ksana_llm.layers.rotary_longrope import LONGROPE_TYPES, LongRopeRotaryEmbedding


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope_type(scaling: dict[str, Any]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def _factor(scaling: dict[str, Any], max_position_embeddings: int) -> float:
    factor = scaling.get("factor")
    if factor is None:  # configs may give only the two lengths
        original = scaling.get("original_max_position_embeddings") or max_position_embeddings
        factor = max_position_embeddings / original
    return float(factor)


def yarn_parameters(rotary_dim: int, theta: float, scaling: dict[str, Any],
                    max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] float32, attention_factor) for a `rope_type: yarn` dict."""
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = _factor(scaling, max_position_embeddings)
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    dims = torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp

    # Always on the CPU, even when the model is being built on the meta device.
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, device="cpu").float() / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) \
        + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def mla_softmax_scale(qk_head_dim: int, scaling: dict[str, Any],
                      max_position_embeddings: int) -> float:
    """DeepSeek's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for any
    scaled RoPE that sets `mscale_all_dim` (as transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    if _rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
        factor = _factor(scaling, max_position_embeddings)
        mscale = yarn_get_mscale(factor, scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class ScaledRotaryEmbedding(RotaryEmbedding):
    """A RotaryEmbedding whose inverse frequencies are given and whose cos/sin tables are
    multiplied by `attention_factor` (in float32, before the cast, as transformers does)."""

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor,
                 attention_factor: float) -> None:
        super().__init__(head_dim, max_positions, theta=10000.0)
        self.inv_freq = inv_freq
        self.attention_factor = attention_factor


def build_rotary(rotary_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any]) -> RotaryEmbedding:
    """YaRN or LongRoPE when the scaling dict asks for it, otherwise the plain / Llama-3 / linear
    table."""
    if _rope_type(scaling) in LONGROPE_TYPES:
        return LongRopeRotaryEmbedding(rotary_dim, max_positions, theta, scaling)
    if _rope_type(scaling) == "yarn":
        inv_freq, attention_factor = yarn_parameters(rotary_dim, theta, scaling, max_positions)
        return ScaledRotaryEmbedding(rotary_dim, max_positions, inv_freq, attention_factor)
    return RotaryEmbedding(rotary_dim, max_positions, theta, scaling)
