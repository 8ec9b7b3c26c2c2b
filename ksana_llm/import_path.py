"""Classes named by import path ("package.module:Class" or "package.module.Class"), as the CLI and
configs name user code (a scheduling policy, logits processors)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_by_path"]


def import_by_path(spec: str, what: str) -> Any:
    """The object `spec` names. `what` says what it is for, in the ValueError raised when the
    path is malformed, its module cannot be imported or has no such name."""
    module_name, sep, name = spec.partition(":")
    if not sep:
        module_name, _, name = spec.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{spec!r} is not a 'module:Class' import path ({what})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for {what} {spec!r}: {exc}") from None
    found = getattr(module, name, None)
    if found is None:
        raise ValueError(f"module {module_name!r} has no {name!r} ({what} {spec!r})")
    return found
