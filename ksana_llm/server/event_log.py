"""The server-sent events of a streamed background response, kept as they are made, so that any
number of readers (the POST that started it, GETs that resume it with `starting_after`) each
follow it from where they want; the run does not depend on any reader staying connected.

An event's index in the log is its `sequence_number` (a response's events count from 0).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class EventLog:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.closed = False
        self._changed = asyncio.Event()

    def append(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        """No more events: readers stop after the last one."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        # Readers wait on the current event; a fresh one serves the next change.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self, starting_after: int | None = None) -> AsyncIterator[str]:
        """The events after sequence number `starting_after` (all of them for None), then
        each new one as it comes, until the log is closed."""
        index = 0 if starting_after is None else starting_after + 1
        while True:
            changed = self._changed
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.closed:
                return
            await changed.wait()
