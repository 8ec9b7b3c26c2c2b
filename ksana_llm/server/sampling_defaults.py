"""Sampling defaults for OpenAI requests that leave a parameter out (vLLM's `--generation-config`
and `--override-generation-config`).

A model's authors often ship the settings it was tuned for in `generation_config.json` (Qwen3:
temperature 0.6, top_p 0.95, top_k 20). As in vLLM, the server reads them from the model folder
by default ("auto"), or from another folder, or not at all ("vllm"); overrides (transformers'
key names, as the file's) go on top. A request's own value always wins; a value equal to
transformers' own default (top_k 50, ...) is not a choice the authors made and is skipped, as
vLLM skips it. `do_sample` is not read: OpenAI requests sample unless temperature is 0.
Beam-search requests take no sampling defaults (beams are deterministic).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ksana_llm.loader.json_files import GENERATION_CONFIG_FILE, read_json_object

# generation_config.json key -> (request parameter, transformers' default)
_KEYS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}
NO_MODEL_DEFAULTS = "vllm"  # vLLM's name for "the server's own defaults only"


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the completion budget when a request names none

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> SamplingDefaults:
        """Defaults from transformers-named `values` (other keys ignored); a ValueError naming
        the key and `source` for a value no request could carry."""
        fields: dict[str, Any] = {}
        for key, (param, hf_default) in _KEYS.items():
            value = values.get(key)
            if value is None or value == hf_default:
                continue
            fields[param] = _checked(key, value, source)
        return cls(**fields)

    def with_overrides(self, overrides: Mapping[str, Any], source: str) -> SamplingDefaults:
        unknown = sorted(set(overrides) - set(_KEYS))
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(_KEYS)})")
        fields = {_KEYS[key][0]: _checked(key, value, source)
                  for key, value in overrides.items() if value is not None}
        return dataclasses.replace(self, **fields)

    def summary(self) -> dict[str, Any]:
        """The defaults that are set, by request parameter."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def fill(self, req: Any) -> Any:
        """`req` (a pydantic request) with its unset sampling parameters taken from here."""
        update = {name: value for name, value in self.summary().items()
                  if name != "max_tokens" and getattr(req, name) is None}
        return req.model_copy(update=update) if update else req


def _checked(key: str, value: Any, source: str) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    integer = isinstance(value, int) and not isinstance(value, bool)
    ok = {
        "temperature": number and math.isfinite(value) and value >= 0,
        "top_p": number and 0 < value <= 1,
        "top_k": integer and value >= -1,
        "min_p": number and 0 <= value <= 1,
        "repetition_penalty": number and math.isfinite(value) and value > 0,
        "max_new_tokens": integer and value >= 1,
    }[key]
    if not ok:
        raise ValueError(f"{source}: {key} = {value!r} is not a valid default")
    return value


def load_sampling_defaults(source: str, model_dir: str | Path | None,
                           overrides: Mapping[str, Any] | None = None) -> SamplingDefaults:
    """`source`: "auto" (the model folder's generation_config.json, when it has one), "vllm"
    (none), or a folder holding a generation_config.json."""
    if source == NO_MODEL_DEFAULTS:
        defaults = SamplingDefaults()
    else:
        folder = Path(model_dir) if source == "auto" and model_dir is not None else Path(source)
        path = folder / GENERATION_CONFIG_FILE
        if source == "auto" and not path.is_file():
            defaults = SamplingDefaults()
        elif not path.is_file():
            raise ValueError(f"--generation-config: no {GENERATION_CONFIG_FILE} in {folder} "
                             f"(give 'auto', '{NO_MODEL_DEFAULTS}' or a folder holding one)")
        else:
            defaults = SamplingDefaults.from_mapping(read_json_object(path), str(path))
    if overrides:
        defaults = defaults.with_overrides(overrides, "--override-generation-config")
    return defaults
