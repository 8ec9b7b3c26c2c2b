"""The README's reference tables say what the code takes: every flag in the server's flag table is
one `ksana-llm serve` accepts, every `serve` flag is named in the README, and the "Engine
settings" table lists exactly `kt.EngineConfig`'s fields. A flag or setting renamed, added or
dropped without its line fails here.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import ksana_llm as kt
from ksana_llm.cli import build_parser

README = (Path(__file__).resolve().parent.parent / "README.md").read_text().splitlines()
ENGINE_SETTINGS_HEADING = ("### Engine settings (`kt.EngineConfig`, or keyword arguments to "
                           "`Engine`)")


def section(heading: str) -> list[str]:
    """The README's lines under `heading`, up to the next heading of any level."""
    start = README.index(heading)
    end = next((i for i in range(start + 1, len(README)) if README[i].startswith("#")),
               len(README))
    return README[start + 1:end]


def first_cells(lines: list[str]) -> list[str]:
    """The first column of each table row (the header and rule rows left out)."""
    return [line.split(" | ")[0] for line in lines
            if line.startswith("| `") and not line.startswith("|---")]


def expanded(text: str) -> str:
    """The README's shorthands spelled out: `--[no-]x` names `--x` and `--no-x`, and
    `--prompt-lookup-min/max` both flags."""
    text = re.sub(r"--\[no-\]([A-Za-z0-9_-]+)", r"--\1 --no-\1", text)
    return re.sub(r"(--[A-Za-z0-9_-]+-)([a-z]+)/([a-z]+)\b", r"\1\2 \1\3", text)


def serve_flags() -> list[list[str]]:
    parser = build_parser()
    commands = next(action for action in parser._actions
                    if isinstance(action, argparse._SubParsersAction))
    return [action.option_strings for action in commands.choices["serve"]._actions
            if action.option_strings and action.help != argparse.SUPPRESS
            and "--help" not in action.option_strings]


def test_every_flag_in_the_server_table_is_accepted():
    accepted = {flag for flags in serve_flags() for flag in flags}
    cells = first_cells(section("## Server"))
    named = [flag for cell in cells for flag in re.findall(r"--[A-Za-z0-9_-]+", expanded(cell))]
    assert len(named) > 100  # the table was found and read
    assert not [flag for flag in named if flag not in accepted]


def test_every_serve_flag_is_named_in_the_readme():
    text = expanded("\n".join(README))
    unnamed = [flags for flags in serve_flags()
               if not any(re.search(re.escape(flag) + r"(?![A-Za-z0-9_-])", text)
                          for flag in flags)]
    assert not unnamed


def test_the_engine_settings_table_lists_every_setting():
    documented = {name for cell in first_cells(section(ENGINE_SETTINGS_HEADING))
                  for name in re.findall(r"`([a-z_0-9]+)`", cell)}
    # `model` is the Engine's first argument, described with the Python API above the table
    assert documented == set(kt.EngineConfig.model_fields) - {"model"}
