"""`--tool-parser-plugin FILE` (vLLM's and KsanaLLM's flag): tool-call parsers of one's own.

The file is imported once at start-up; every `ToolParser` subclass it defines with a `name`
becomes a parser `--tool-call-parser NAME` can pick, next to the built-in ones, for this server
only (nothing global is changed). The simplest kind subclasses `WholeTextToolParser` and writes
`parse(text) -> ParsedOutput`; a `ToolParser` with its own `stream()` streams calls as they are
generated. (vLLM's plugin classes have another interface and do not load here.)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from ksana_llm.api.plugin import import_source_file
from ksana_llm.server.tool_parsers.base import ToolParser


def load_tool_parser_plugin(path: str, builtin: Mapping[str, type[ToolParser]]
                            ) -> Mapping[str, type[ToolParser]]:
    """The parsers `path` defines, by name. ValueError naming the flag when the file is
    missing, fails to import, defines none, or reuses a built-in parser's name."""
    flag = f"--tool-parser-plugin {path}"
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag}: no such file")
    try:
        module = import_source_file(file, "ksana_llm_tool_parser_plugin_")
    except Exception as exc:  # noqa: BLE001 - a broken plugin fails in any way; start-up stops
        raise ValueError(f"{flag}: importing it failed ({type(exc).__name__}: {exc})") from exc
    module_name = module.__name__
    parsers: dict[str, type[ToolParser]] = {}
    for _, cls in inspect.getmembers(module, inspect.isclass):
        name = cls.__dict__.get("name")  # its own: a helper base class without one is skipped
        if cls.__module__ != module_name or not issubclass(cls, ToolParser) \
                or inspect.isabstract(cls) or name is None:
            continue
        if not isinstance(name, str) or not name:
            raise ValueError(f"{flag}: parser class {cls.__name__}'s `name` must be a "
                             f"non-empty string, got {name!r}")
        if name in builtin:
            raise ValueError(f"{flag}: {cls.__name__} is named {name!r}, a built-in parser's name")
        if name in parsers:
            raise ValueError(f"{flag}: two parser classes are named {name!r}")
        try:  # made once here, so that a constructor that fails stops start-up, named
            cls()
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{flag}: {cls.__name__}() failed ({type(exc).__name__}: "
                             f"{exc})") from exc
        parsers[name] = cls
    if not parsers:
        raise ValueError(f"{flag}: it defines no ToolParser subclass with a `name` of its own "
                         "(and `parse` for a WholeTextToolParser, else `stream`)")
    return MappingProxyType(parsers)
