"""Model loading: locate a model (HF folder, GGUF file, or the bundled default) and stream its weights."""

from .default_model import DEFAULT_MODEL_INSTALL_HINT, default_model_gguf
from .gguf_convert import CACHE_ENV_VAR, convert_gguf_to_hf, default_cache_dir, gguf_cache_path
from .hf_config import load_hf_config
from .weight_map import (DEPRECATED, PACKAGE_WEIGHT_MAP_DIR, WeightMap, WeightMapEntry, find_weight_map,
                         load_weight_map, weight_map_filename, weight_map_for)
from .weights import iterate_weights, resolve_model_dir

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_MODEL_INSTALL_HINT",
    "DEPRECATED",
    "PACKAGE_WEIGHT_MAP_DIR",
    "WeightMap",
    "WeightMapEntry",
    "convert_gguf_to_hf",
    "default_cache_dir",
    "default_model_gguf",
    "find_weight_map",
    "gguf_cache_path",
    "iterate_weights",
    "load_hf_config",
    "load_weight_map",
    "resolve_model_dir",
    "weight_map_filename",
    "weight_map_for",
]
