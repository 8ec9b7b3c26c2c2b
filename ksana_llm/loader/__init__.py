"""Model loading: locate a model (HF folder, GGUF file, or the bundled default) and stream its weights."""

from .default_model import DEFAULT_MODEL_INSTALL_HINT, default_model_gguf
from .hf_config import load_hf_config
from .gguf_convert import CACHE_ENV_VAR, convert_gguf_to_hf, default_cache_dir, gguf_cache_path
from .weights import iterate_weights, resolve_model_dir

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_MODEL_INSTALL_HINT",
    "convert_gguf_to_hf",
    "default_cache_dir",
    "default_model_gguf",
    "gguf_cache_path",
    "iterate_weights",
    "load_hf_config",
    "resolve_model_dir",
]
