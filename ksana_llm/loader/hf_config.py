"""Reading a checkpoint's `config.json` into a transformers config object."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ksana_llm.loader.json_files import read_json_object
from ksana_llm.loader.multimodal_text import language_model_config

logger = logging.getLogger("ksana_llm.loader")


def load_hf_config(model_dir: str | Path, overrides: Mapping[str, Any] | None = None) -> Any:
    """The folder's config, with `overrides` (vLLM's `hf_overrides`) applied. Families whose
    configs live in remote code (Qwen v1, Baichuan) are unknown to transformers, and we never
    run remote code: for those, the plain keys of config.json in a `PretrainedConfig`, which
    our model classes read by name."""
    config = _read_hf_config(model_dir)
    if overrides:
        apply_hf_overrides(config, overrides)
    return language_model_config(config)


def apply_hf_overrides(config: Any, overrides: Mapping[str, Any], prefix: str = "") -> None:
    """Set each key of `overrides` on the config, as vLLM's `hf_overrides` does: a dict given
    for a sub-config (a multimodal model's `text_config`, say) updates that sub-config's keys,
    anything else replaces the value (or adds the key). ValueError naming a key that is not a
    string."""
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"hf_overrides: keys must be non-empty strings, got {key!r}")
        current = getattr(config, key, None)
        if isinstance(value, Mapping) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value, prefix=f"{prefix}{key}.")
        elif not _set_rope_key(config, key, value):
            setattr(config, key, value)
        logger.info("hf_overrides: %s%s = %r", prefix, key, value)


def _set_rope_key(config: Any, key: str, value: Any) -> bool:
    """transformers 5 keeps `rope_theta` inside `rope_parameters` (of which `rope_scaling` is
    the old name), and reads it only there: a `rope_theta` override must land there too, and a
    new scaling dict keeps the checkpoint's theta unless it names one. False: not such a key,
    or a config without `rope_parameters` (set it plainly)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return False
    if key == "rope_theta":
        config.rope_parameters = {**params, "rope_theta": value}
        setattr(config, key, value)
        return True
    if key in ("rope_scaling", "rope_parameters") and isinstance(value, Mapping):
        theta = {"rope_theta": params["rope_theta"]} if "rope_theta" in params else {}
        config.rope_parameters = {**theta, **value}
        return True
    return False


def hf_overrides_applied(config: Any, overrides: Mapping[str, Any]) -> bool:
    """Whether `config` already holds every value `overrides` would set."""
    from transformers import PretrainedConfig

    missing = object()
    for key, value in overrides.items():
        current = getattr(config, key, missing)
        if isinstance(value, Mapping) and isinstance(current, PretrainedConfig):
            if not hf_overrides_applied(current, value):
                return False
        elif isinstance(value, Mapping) and isinstance(current, Mapping):
            # (a rope dict holds the checkpoint's rope_theta beside what was asked)
            if any(current.get(k, missing) != v for k, v in value.items()):
                return False
        elif current is missing or current != value:
            return False
    return True


def _read_hf_config(model_dir: str | Path) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: transformers 4 validates no config this way
        StrictDataclassError = ()  # noqa: N806  (an except clause that catches nothing)

    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except StrictDataclassError as exc:
        # A transformers config class refused its values (e.g. LongRoPE factors of the wrong
        # length): the config is wrong, not foreign.
        raise ValueError(f"config.json of {model_dir} fails transformers' checks: {exc}") from exc
    except (ValueError, KeyError) as exc:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise
        logger.info("config.json of %s is not a transformers config (%s); reading its keys as they are",
                    model_dir, exc)
        data = read_json_object(path)
        # model_type is a read-only class attribute of PretrainedConfig: keep it on the instance.
        model_type = data.pop("model_type", None)
        config = PretrainedConfig(**data)
        config.__dict__["model_type"] = model_type
        return config
