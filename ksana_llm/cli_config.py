"""vLLM's `serve --config FILE`: a YAML file of the command's own flags, by their long names
(`max-model-len: 4096`, `max_model_len` too), taken as the command's defaults, so a flag given
on the command line wins. (KsanaLLM's own YAML, with its nested `setting:` keys, is
`--config_file`.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from ksana_llm.yaml_config import load_yaml_strictly

__all__ = ["config_file_values"]


def config_file_values(parser: argparse.ArgumentParser, path: str,
                       given_model: bool) -> argparse.Namespace:
    """What the flags file `path` sets, as `parser` (a subcommand's) stores it: a namespace
    holding those attributes only (`parser.parse_args(argv, namespace=...)` then lays the
    command line over them). `model` is left out when the command line names a model already.
    ValueError naming `--config` and the key for a file that cannot be read, is not a mapping,
    gives a key twice, sets what `parser` does not take, or a value its flag refuses.

    The values go through the flags' own actions one by one rather than as words put before
    the command line's: a list flag's words would swallow the command line's positional model
    (`served-model-name: [a, b]` then `serve MODEL`)."""
    try:
        data = load_yaml_strictly(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"--config: cannot read {path}: {exc}") from None
    namespace = argparse.Namespace()
    if data is None:
        return namespace
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of flag names to values, got "
                         f"{type(data).__name__}")
    actions = {option: action for action in parser._actions for option in action.option_strings}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ValueError(f"--config: {path}: key {key!r} is not a flag name")
        if key in ("model", "model_tag") and given_model:
            continue  # the command line's model wins
        option = next((o for o in (f"--{key}", f"--{key.replace('_', '-')}") if o in actions),
                      None)
        if option is None or option == "--config":
            raise ValueError(f"--config: {path}: {key!r} is not a flag of this command")
        action = actions[option]
        for option_string, words in _as_words(option, action, value, path, key):
            try:
                values = parser._get_values(action, words)
            except argparse.ArgumentError as exc:
                raise ValueError(f"--config: {path}: {key}: {exc.message}") from None
            action(parser, namespace, values, option_string)
    return namespace


def _as_words(option: str, action: argparse.Action, value: Any, path: str, key: str
              ) -> list[tuple[str, list[str]]]:
    """`option` set to `value`: each time the flag is given, as the option string and its
    words on a command line."""
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise ValueError(f"--config: {path}: {key} is a switch: true or false, got {value!r}")
        if value:
            return [(option, [])]
        negative = f"--no-{option[2:]}"
        return [(negative, [])] if negative in action.option_strings else []
    if value is None:
        return []
    if action.nargs == "?" and isinstance(value, bool):
        # `--hf-token` alone (true: the flag's own meaning without a value) or not at all.
        return [(option, [])] if value else []
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [(option, [_word(item) for item in value])]
    if isinstance(value, list) and isinstance(action, argparse._AppendAction):
        return [(option, [_word(item)]) for item in value]  # a repeatable flag, once each
    # One value (a list here is JSON text, which only a JSON-valued flag takes: another one's
    # type refuses it, naming the key).
    return [(option, [_word(value)])]


def _word(value: Any) -> str:
    """A YAML value as the command line would spell it (objects as JSON, as flags take them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
