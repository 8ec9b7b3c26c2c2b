"""Value types for the command line's flags: each parses one argument or raises argparse's
ArgumentTypeError, so a bad value is refused as the flags are read (before any model loads)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable


def number(kind: type, low: float, low_ok: bool, high: float | None = None
           ) -> Callable[[str], int | float]:
    """An argparse type: a `kind` number above `low` (or equal to it, with `low_ok`) and at
    most `high`, checked as the flags are parsed (before any model loads)."""
    def parse(value: str) -> int | float:
        try:
            parsed = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: "
                                             f"{value!r}") from None
        if not math.isfinite(parsed) or parsed < low or (parsed == low and not low_ok) or (
                high is not None and parsed > high):
            bound = f">= {low}" if low_ok else f"> {low}"
            raise argparse.ArgumentTypeError(
                f"must be {bound}" + (f" and <= {high}" if high is not None else "") + f", got {value}")
        return parsed
    return parse


port = number(int, 0, True, 65535)
positive_int = number(int, 0, False)
non_negative_int = number(int, 0, True)
positive_float = number(float, 0.0, False)
non_negative_float = number(float, 0.0, True)


def non_empty_str(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def json_value(value: str) -> object:
    try:
        return json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc


def json_object(value: str) -> dict:
    parsed = json_value(value)
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return parsed


def preemption_mode(value: str) -> int:
    modes = {"swap": 0, "recompute": 1, "0": 0, "1": 1}
    if value not in modes:
        raise argparse.ArgumentTypeError(f"expected swap or recompute, got {value!r}")
    return modes[value]


def json_strings(value: str) -> list[str]:
    parsed = json_value(value)
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError("expected a JSON list of strings")
    return parsed


def scheduling_policy(value: str) -> str:
    return "fifo" if value == "fcfs" else value


def lora_module(value: str) -> tuple[str, str]:
    """vLLM's two forms: NAME=PATH, or JSON '{"name": ..., "path": ...}' (its
    `base_model_name` is taken and not needed: an adapter's parent is the served model)."""
    if value.lstrip().startswith("{"):
        spec = json_value(value)
        unknown = set(spec) - {"name", "path", "base_model_name"} if isinstance(spec, dict) else ()
        if not isinstance(spec, dict) or unknown or not all(
                isinstance(spec.get(key), str) and spec[key] for key in ("name", "path")):
            raise argparse.ArgumentTypeError(
                f"expected NAME=PATH or a JSON object with \"name\" and \"path\" (and optionally "
                f"\"base_model_name\"), got {value!r}")
        return spec["name"], spec["path"]
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or vLLM's JSON form, got {value!r}")
    return name, path


# vLLM's --speculative-config keys -> EngineConfig fields.
_SPECULATIVE_KEYS = {"num_speculative_tokens": "num_speculative_tokens",
                     "prompt_lookup_min": "prompt_lookup_min",
                     "prompt_lookup_max": "prompt_lookup_max",
                     "disable_by_batch_size": "speculative_disable_by_batch_size"}
# vLLM's method names -> ours: drafts from the sequence itself, or from DeepSeek's MTP layer.
_SPECULATIVE_METHODS = {"ngram": "ngram", "deepseek_mtp": "mtp", "mtp": "mtp"}


def speculative_config(value: str) -> dict[str, object]:
    """vLLM's `--speculative-config` JSON, e.g. '{"method": "ngram", "num_speculative_tokens":
    4, "prompt_lookup_max": 4}', as EngineConfig fields. Only the methods this engine has
    (ngram, deepseek_mtp / mtp) are taken; a draft model, EAGLE or Medusa is refused, and so is
    a key this engine has no setting for."""
    parsed = json_object(value)
    method = parsed.pop("method", None)
    model = parsed.pop("model", None)
    if method is None and model == "[ngram]":  # vLLM's older spelling of the ngram method
        method, model = "ngram", None
    if model is not None:
        raise argparse.ArgumentTypeError(
            f"\"model\": {model!r}: draft models are not supported; drafts come from the "
            "sequence itself (\"method\": \"ngram\") or the model's MTP layer (\"deepseek_mtp\")")
    if method not in _SPECULATIVE_METHODS:
        raise argparse.ArgumentTypeError(
            f"\"method\" must be one of {', '.join(_SPECULATIVE_METHODS)}, got {method!r}")
    unknown = sorted(set(parsed) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unsupported key(s) {', '.join(unknown)}; known: method, "
            f"{', '.join(_SPECULATIVE_KEYS)}")
    if "num_speculative_tokens" not in parsed:
        raise argparse.ArgumentTypeError("\"num_speculative_tokens\" is required")
    fields: dict[str, object] = {"speculative_method": _SPECULATIVE_METHODS[method]}
    fields.update({_SPECULATIVE_KEYS[key]: item for key, item in parsed.items()})
    return fields


# Suffixes of byte sizes: decimal (K, M, G, T) and binary (Ki, Mi, Gi, Ti), an optional "B".
_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def byte_size(value: str) -> int:
    """A positive number of bytes: 8000000000, 8e9, 8G, 8GB, 7.5GiB (case-insensitive)."""
    text = value.strip().lower().removesuffix("b")
    number_part = text.rstrip("kmgti")
    unit = text[len(number_part):]
    try:
        amount = float(number_part) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a byte size (like 8e9, 8G or 7.5GiB): "
                                         f"{value!r}") from None
    if not math.isfinite(amount) or amount < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {value!r}")
    return int(amount)
