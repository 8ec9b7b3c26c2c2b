"""Per-layer scales for an FP8 (E4M3) KV cache: `kv_cache_scales.json` in the model folder.

The format is KsanaLLM's (and vLLM's `KVCacheQuantSchema`), as calibration tools write it:

    {"model_type": "qwen",
     "kv_cache": {"dtype": "float8_e4m3fn",
                  "scaling_factor": {"0": {"0": 0.0408, "1": 0.0427, ...}}}}

`scaling_factor` maps a tensor-parallel rank to {layer index: scale}; like KsanaLLM, only rank "0"
is read, and its scales serve every rank (one scalar per layer, shared by K and V). A cache entry
is value / scale, so a scale of max|K, V| / 448 makes a layer's values span E4M3's range.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from ksana_llm.loader.json_files import read_json_object

logger = logging.getLogger("ksana_llm.loader")

KV_SCALES_FILENAME = "kv_cache_scales.json"


def load_kv_cache_scales(model_dir: str | Path, num_layers: int) -> list[float] | None:
    """The scale of each of the first `num_layers` layers from `<model_dir>/kv_cache_scales.json`,
    1.0 for a layer the file leaves out; None when there is no such file. Raises ValueError naming
    the file when it is malformed (a scale must be a positive finite number, a layer index one
    of the model's)."""
    path = Path(model_dir) / KV_SCALES_FILENAME
    if not path.is_file():
        return None
    try:
        data = read_json_object(path)
    except OSError as exc:
        raise ValueError(f"{path}: not a readable file: {exc}") from None
    kv_cache = data.get("kv_cache")
    factors = kv_cache.get("scaling_factor") if isinstance(kv_cache, dict) else None
    if not isinstance(factors, dict) or not isinstance(factors.get("0"), dict):
        raise ValueError(f'{path}: expected {{"kv_cache": {{"scaling_factor": {{"0": '
                         f'{{"<layer>": <scale>, ...}}}}}}}} (tensor-parallel rank "0")')
    dtype = kv_cache.get("dtype", "float8_e4m3fn")
    if dtype not in ("float8_e4m3fn", "fp8_e4m3", "fp8"):
        raise ValueError(f"{path}: kv_cache.dtype is {dtype!r}; these scales are for an "
                         "float8_e4m3fn cache")
    scales = [1.0] * num_layers
    for layer, scale in factors["0"].items():
        try:
            index = int(layer)
        except ValueError:
            raise ValueError(f"{path}: layer {layer!r} is not an integer") from None
        if not 0 <= index < num_layers:
            raise ValueError(f"{path}: layer {index} is not one of the model's {num_layers}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"{path}: layer {index}'s scale must be a positive number, "
                             f"got {scale!r}")
        scales[index] = float(scale)
    missing = num_layers - len(factors["0"])
    if missing:
        logger.warning("%s: %d of %d layers have no scale; they use 1.0", path, missing,
                       num_layers)
    if len(factors) > 1:
        logger.warning("%s: only tensor-parallel rank 0's scales are read (KsanaLLM's rule)", path)
    return scales
