"""RoPE scaling a GGUF file states, carried into the config.json of its converted folder.

transformers' GGUF reader (which does the conversion) keeps only the RoPE base: it skips the
`rope_freqs.weight` tensor in which llama.cpp stores Llama 3.1/3.2's frequency scaling, and the
`<arch>.rope.scaling.*` metadata of linear and YaRN scaling. A converted Llama 3.1 would then
serve the unscaled model, wrong past a few thousand tokens, without a word. This module reads
both back and states them as transformers' `rope_parameters`; what it cannot state exactly is
refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["gguf_rope_scaling", "llama3_rope_factors", "with_rope_scaling"]

# What llama.cpp's converter writes for Llama 3 (and transformers' defaults for llama3 scaling).
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192


def llama3_rope_factors(theta: float, rotary_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> np.ndarray:
    """The divisor of each rotary frequency under Llama 3's scaling, as llama.cpp stores it in
    `rope_freqs.weight` (1 for short wavelengths, `factor` for long ones, smooth between)."""
    freqs = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float64)


def gguf_rope_scaling(gguf_path: Path, theta: float, rotary_dim: int) -> dict[str, Any] | None:
    """The scaling the file states, as `rope_parameters` fields (without `rope_theta`), or None
    for plain RoPE. ValueError naming the file for scaling that cannot be stated exactly."""
    from gguf import GGUFReader  # a dependency of transformers' GGUF support

    reader = GGUFReader(str(gguf_path))
    fields = reader.fields

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    kind = value(f"{arch}.rope.scaling.type")
    factor = value(f"{arch}.rope.scaling.factor")
    original = value(f"{arch}.rope.scaling.original_context_length")
    stored = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if stored is not None:
        return _llama3_from_factors(gguf_path, np.asarray(stored.data, dtype=np.float64).reshape(-1),
                                    theta, rotary_dim, original)
    if kind in (None, "none") or factor in (None, 1.0, 0.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and original:
        return {"rope_type": "yarn", "factor": float(factor),
                "original_max_position_embeddings": int(original)}
    raise ValueError(f"{gguf_path}: RoPE scaling {kind!r} (factor {factor}) is not supported "
                     "for GGUF files")


def _llama3_from_factors(gguf_path: Path, stored: np.ndarray, theta: float, rotary_dim: int,
                         original: int | None) -> dict[str, Any]:
    """Llama 3's scaling parameters that reproduce the stored per-frequency divisors: the factor
    is their largest, the low/high frequency factors llama.cpp's 1 and 4, the original context
    the file's, Llama 3's 8192, or the power of two that fits."""
    factor = float(stored.max())
    candidates = [c for c in (original, _LLAMA3_ORIGINAL_CONTEXT) if c] + [2**k for k in range(4, 21)]
    for context in dict.fromkeys(int(c) for c in candidates):
        expected = llama3_rope_factors(theta, rotary_dim, factor, _LLAMA3_LOW_FREQ_FACTOR,
                                       _LLAMA3_HIGH_FREQ_FACTOR, context)
        if expected.shape == stored.shape and np.allclose(expected, stored, rtol=1e-4, atol=1e-6):
            return {"rope_type": "llama3", "factor": factor,
                    "low_freq_factor": _LLAMA3_LOW_FREQ_FACTOR,
                    "high_freq_factor": _LLAMA3_HIGH_FREQ_FACTOR,
                    "original_max_position_embeddings": context}
    raise ValueError(f"{gguf_path}: rope_freqs.weight holds frequency factors that are not "
                     "Llama 3's scaling (low/high frequency factors 1 and 4); such files are "
                     "not supported")


def with_rope_scaling(config: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """`config` (a config.json's dict) with `scaling` stated in the key its transformers version
    writes: `rope_parameters` (5.x, holding `rope_theta` too) or `rope_scaling` (4.x)."""
    if isinstance(config.get("rope_parameters"), dict):
        return {**config, "rope_parameters": {**config["rope_parameters"], **scaling}}
    return {**config, "rope_scaling": {**scaling, "type": scaling["rope_type"]}}
