"""FP8 KV cache: how K/V values become cache entries and back (torch only, no triton).

An FP8 cache (KsanaLLM `quantization_config.kv_cache.dtype`, vLLM `--kv-cache-dtype`) keeps one
byte per number instead of two (or four): twice the tokens in the same memory. A cache entry is
`value / scale` rounded to the FP8 type, and reads as `entry * scale`, with one scale per layer
shared by K and V (KsanaLLM's `kv_cache_scales.json`; 1.0 when none is given). Values beyond the
type's range saturate to its largest finite number instead of becoming inf / NaN.

Everything that reads the cache reads these dequantized values, so attention always sees the
rounded K/V: the torch backend, the Triton kernels (which load the bytes and scale in registers)
and the chunk that is written in the same step alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from ksana_llm.loader.weight_quant import E4M3_AS_HALF_FACTOR, e4m3_as_half

# User-facing names -> storage types. "fp8" is vLLM's name for E4M3.
FP8_KV_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
})


def cache_dtype_for(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage type for `EngineConfig.kv_cache_dtype`: "auto" keeps the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(FP8_KV_DTYPES)}, "
                         f"got {name!r}")
    return FP8_KV_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def raw(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its bytes (a uint8 view), anything else as it is. Gathers and scatters
    run on the bytes: torch's indexing kernels do not cover the FP8 types on every device."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def to_cache(values: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K/V values as entries of a `cache_dtype` cache (a plain cast unless it is FP8)."""
    if not is_fp8(cache_dtype):
        return values.to(cache_dtype)
    if scale != 1.0:
        values = values / scale
    limit = torch.finfo(cache_dtype).max
    return values.clamp(-limit, limit).to(cache_dtype)


def from_cache(entries: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache entries as `dtype` values (a plain cast unless they are FP8)."""
    if not is_fp8(entries.dtype):
        return entries.to(dtype)
    if entries.dtype == torch.float8_e4m3fn and entries.device.type == "cpu":
        # torch widens E4M3 ~6x slower than E5M2 on a CPU; its bytes moved into float16's
        # fields are the same values / 256, exactly (entries are clamped, never NaN), and one
        # multiply by a power of two times the scale rounds as `value * scale` does.
        values = e4m3_as_half(entries).to(dtype)  # a new tensor: safe to scale in place
        return values.mul_(scale * E4M3_AS_HALF_FACTOR)
    values = entries.to(dtype)  # a new tensor (the types differ): safe to scale in place
    return values.mul_(scale) if scale != 1.0 else values


def through_cache(values: torch.Tensor, cache_dtype: torch.dtype,
                  scale: float = 1.0) -> torch.Tensor:
    """`values` as they read back from a `cache_dtype` cache: rounded when it is FP8, unchanged
    otherwise. For K/V attended straight from the step's projection, so that attention sees the
    same numbers it will see in later steps."""
    if not is_fp8(cache_dtype):
        return values
    return from_cache(to_cache(values, cache_dtype, scale), values.dtype, scale)
