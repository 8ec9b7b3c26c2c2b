"""Stopping an engine its script never shut down, before the interpreter exits.

A script that ends without `shutdown()` while a request runs would otherwise end inside a step:
the interpreter tears the engine's daemon thread down mid-forward and the process aborts
(torch's threads: "terminate called without an active exception", SIGABRT). `atexit` runs
before that. The hook holds its engine weakly, so an engine dropped early is still freed.
"""

from __future__ import annotations

import atexit
import functools
import weakref
from typing import Any


class ExitHook:
    """Registered for one engine at its start; `cancel()` when it shuts down by itself."""

    def __init__(self, engine: Any) -> None:
        self._hook = functools.partial(_shutdown_if_alive, weakref.ref(engine))
        atexit.register(self._hook)

    def cancel(self) -> None:
        atexit.unregister(self._hook)


def _shutdown_if_alive(engine: weakref.ref[Any]) -> None:
    alive = engine()
    if alive is not None:
        alive.shutdown()
