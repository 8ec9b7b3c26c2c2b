"""LongRoPE (`rope_type` "longrope", formerly "su"): Phi-3-128k, Phi-3.5 and Phi-4-mini's RoPE.

Two sets of per-frequency factors divide the inverse frequencies: `short_factor` while a sequence
fits the model's original context (`original_max_position_embeddings`), `long_factor` once it is
longer. Both tables are multiplied by one `attention_factor` (sqrt(1 + ln(f) / ln(original)),
f = max_position_embeddings / original, unless the config gives it).

Which set a token takes follows transformers: a forward over a sequence longer than the original
context uses the long factors at every position, and a sequence that grows past it during decoding
has its whole KV recomputed with them (transformers' Phi-3 drops its cache at that step). Here the
scheduler does that recompute (`Sequence.long_rope`, engine.scheduler), the runner marks the rows
of such sequences (`AttentionMetadata.long_rope_rows`), and this table picks by row. A decode row
needs no mark: its position is past the original context exactly when its sequence is long, which
keeps captured CUDA graphs (no marks) exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ksana_llm.layers.rotary import RotaryEmbedding

LONGROPE_TYPES = ("longrope", "su")


def longrope_attention_factor(scaling: dict[str, Any], max_positions: int, original: int) -> float:
    """The config's `attention_factor`, else the LongRoPE paper's from the extension factor."""
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """One table of 2 parts: rows [0, original) the short factors' positions 0..original-1, rows
    [original, original + max_positions) the long factors' positions 0..max_positions-1."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any]) -> None:
        super().__init__(rotary_dim, max_positions, theta)
        original = scaling.get("original_max_position_embeddings")
        if not original:
            raise ValueError("rope_scaling type 'longrope' needs original_max_position_embeddings")
        self.switch_length = int(original)
        # On the CPU, even when the model is being built on the meta device.
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() \
            / rotary_dim
        self.short_inv_freq, self.long_inv_freq = (
            self._inv_freq(scaling, key, rotary_dim, theta, exponents)
            for key in ("short_factor", "long_factor"))
        self.attention_factor = longrope_attention_factor(scaling, max_positions, self.switch_length)

    @staticmethod
    def _inv_freq(scaling: dict[str, Any], key: str, rotary_dim: int, theta: float,
                  exponents: torch.Tensor) -> torch.Tensor:
        factors = scaling.get(key)
        if not isinstance(factors, (list, tuple)) or len(factors) != rotary_dim // 2:
            raise ValueError(f"rope_scaling {key} must list {rotary_dim // 2} factors (one per "
                             f"rotary frequency), got {factors!r}")
        # transformers' expression, so the tables agree to the last bit.
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * theta ** exponents)

    def _angles(self) -> torch.Tensor:
        return torch.cat((
            torch.outer(torch.arange(self.switch_length, dtype=torch.float32, device="cpu"),
                        self.short_inv_freq),
            torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device="cpu"),
                        self.long_inv_freq)))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                long_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        long = positions >= self.switch_length
        if long_rows is not None:
            long = long | long_rows
        return self._rows(positions + long * self.switch_length, dtype)
