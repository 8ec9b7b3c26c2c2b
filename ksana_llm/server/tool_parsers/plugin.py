"""`--tool-parser-plugin FILE` (vLLM's and KsanaLLM's flag): tool-call parsers of one's own.

The file is imported once at start-up; every `ToolParser` subclass it defines with a `name`
becomes a parser `--tool-call-parser NAME` can pick, next to the built-in ones, for this server
only (nothing global is changed). The simplest kind subclasses `WholeTextToolParser` and writes
`parse(text) -> ParsedOutput`; a `ToolParser` with its own `stream()` streams calls as they are
generated. (vLLM's plugin classes have another interface and do not load here.)
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from ksana_llm.server.tool_parsers.base import ToolParser


def load_tool_parser_plugin(path: str, builtin: Mapping[str, type[ToolParser]]
                            ) -> Mapping[str, type[ToolParser]]:
    """The parsers `path` defines, by name. ValueError naming the flag when the file is
    missing, fails to import, defines none, or reuses a built-in parser's name."""
    flag = f"--tool-parser-plugin {path}"
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag}: no such file")
    # A name of its own per file, so two plugins (or a plugin named like a package) never clash.
    module_name = "ksana_llm_tool_parser_plugin_" + hashlib.sha1(
        str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # Registered while it runs, as an import would: dataclasses and pickling look it up there.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken plugin fails in any way; start-up stops
        del sys.modules[module_name]
        raise ValueError(f"{flag}: importing it failed ({type(exc).__name__}: {exc})") from exc
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
