"""A factory for the module-scoped engines many test files build on the default model."""

from __future__ import annotations

from typing import Any

import pytest


def engine_fixture(**engine_args: Any):
    """A module-scoped fixture yielding `Engine(default_model, **engine_args)`, shut down after the
    module: assign it to the name the tests ask for (`engine = engine_fixture(...)`)."""

    @pytest.fixture(scope="module")
    def engine(default_model):
        import ksana_llm as kt

        with kt.Engine(default_model, **engine_args) as built:
            yield built

    return engine


def wait_until_idle(engine: Any, timeout: float = 60.0) -> bool:
    """Whether `engine` has nothing running or waiting within `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return True
        time.sleep(0.05)
    return False


def stats_once_blocks_free(engine: Any, timeout: float = 10.0) -> Any:
    """`engine.stats()` once every KV block is free again (an aborted request's blocks go
    back on the engine thread, a moment after its handle finishes), or at `timeout`."""
    import time

    deadline = time.monotonic() + timeout
    stats = engine.stats()
    while stats.num_free_kv_blocks != stats.num_kv_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
        stats = engine.stats()
    return stats
