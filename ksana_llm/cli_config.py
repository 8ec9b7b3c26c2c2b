"""vLLM's `serve --config FILE`: a YAML file of the command's own flags, by their long names
(`max-model-len: 4096`, `max_model_len` too), read as if they were typed before the command
line's flags, so a flag given on the command line wins. (KsanaLLM's own YAML, with its nested
`setting:` keys, is `--config_file`.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

__all__ = ["config_file_flags"]


def config_file_flags(parser: argparse.ArgumentParser, path: str,
                      given_model: bool) -> list[str]:
    """The flags file `path` sets, as `parser` (a subcommand's) takes them; `model` is left
    out when the command line names a model already. ValueError naming `--config` and the key
    for a file that cannot be read, is not a mapping, or sets what `parser` does not take."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"--config: cannot read {path}: {exc}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of flag names to values, got "
                         f"{type(data).__name__}")
    actions = {option: action for action in parser._actions for option in action.option_strings}
    flags: list[str] = []
    for key, value in data.items():
        if not isinstance(key, str):
            raise ValueError(f"--config: {path}: key {key!r} is not a flag name")
        if key in ("model", "model_tag") and given_model:
            continue  # the command line's model wins
        option = next((o for o in (f"--{key}", f"--{key.replace('_', '-')}") if o in actions),
                      None)
        if option is None or option == "--config":
            raise ValueError(f"--config: {path}: {key!r} is not a flag of this command")
        flags.extend(_as_flags(option, actions[option], value, path, key))
    return flags


def _as_flags(option: str, action: argparse.Action, value: Any, path: str, key: str
              ) -> list[str]:
    """`option` set to `value` as command-line words."""
    takes_no_value = action.nargs == 0
    if takes_no_value:
        if not isinstance(value, bool):
            raise ValueError(f"--config: {path}: {key} is a switch: true or false, got {value!r}")
        if value:
            return [option]
        negative = f"--no-{option[2:]}"
        return [negative] if negative in action.option_strings else []
    if value is None:
        return []
    if isinstance(value, list):
        return [option, *(_word(item) for item in value)]
    return [option, _word(value)]


def _word(value: Any) -> str:
    """A YAML value as the command line would spell it (objects as JSON, as flags take them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
