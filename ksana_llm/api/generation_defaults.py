"""An engine's default `GenerationConfig`: the one its model's authors ship.

transformers' `generate()` starts from the model folder's `generation_config.json` (Qwen3:
sampling at temperature 0.6, top_p 0.95, top_k 20), and so does vLLM's `LLM` (its
`generation_config="auto"`). So does `Engine` when it is given no `generation_config`: the
decoding keys below are read from the file, and the rest keeps our defaults (`max_new_tokens`
128 where the file names none). A value `GenerationConfig` refuses is left out with a warning:
a model folder must not stop an engine from starting. The server has its own, vLLM-shaped,
defaults for OpenAI requests (`server.sampling_defaults`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.loader.json_files import GENERATION_CONFIG_FILE, read_json_object

logger = logging.getLogger("ksana_llm.api")

# generation_config.json keys that mean the same here (transformers' names).
_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
         "no_repeat_ngram_size", "max_new_tokens", "min_new_tokens")

__all__ = ["model_generation_config"]


def model_generation_config(model_dir: Path) -> GenerationConfig:
    """Our defaults with the decoding keys of the folder's generation_config.json, as
    transformers applies them."""
    config = GenerationConfig()
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return config
    values = read_json_object(path)
    taken: dict[str, Any] = {}
    for key in _KEYS:  # in this order: max_new_tokens before min_new_tokens, which it bounds
        value = values.get(key)
        if value is None:
            continue
        try:
            config = config.replace(**{key: value})
        except ValueError as exc:
            logger.warning("%s: %s=%r is not used (%s)", path, key, value, exc)
            continue
        taken[key] = value
    if taken:
        logger.info("default generation settings from %s: %s", path, taken)
    return config
