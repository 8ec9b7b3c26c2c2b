"""Stored responses (`store: true`), for `GET /v1/responses/{id}` (and its `input_items`) and
`previous_response_id`.

In memory and bounded: past `max_entries` the least recently used response is dropped, so a
server that answers forever does not grow forever (a dropped id is a 404, as an unknown one).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    # The items it answered, each with its `id`: the conversation before it (every input and
    # output item of its previous_response_id's chain), then its own new input.
    inputs: list[dict[str, Any]]
    # A background response created with `stream: true`: its server-sent events, which
    # `GET /v1/responses/{id}?stream=true` replays (empty otherwise: it cannot be streamed).
    events: tuple[str, ...] = ()

    @property
    def items(self) -> list[dict[str, Any]]:
        """The conversation so far: its input items, then its output items."""
        return self.inputs + self.body["output"]


def item_page(items: list[dict[str, Any]], *, limit: int, order: str, after: str | None = None,
              before: str | None = None) -> dict[str, Any]:
    """One page of `items` as OpenAI lists them: `order` "desc" lists the last item first;
    `after` / `before` are item ids the page starts after / ends before, in that order.
    An unknown cursor id is a LookupError naming the parameter."""
    ordered = items[::-1] if order == "desc" else list(items)
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for param, cursor in (("after", after), ("before", before)):
        if cursor is None:
            continue
        if cursor not in ids:
            raise LookupError(param)
        if param == "after":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    if before is not None and after is None:
        # A page that ends before the cursor: the items nearest to it.
        page, has_more = ordered[max(start, end - limit):end], end - start > limit
    else:
        page, has_more = ordered[start:min(end, start + limit)], end - start > limit
    return {"object": "list", "data": page, "has_more": has_more,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_entries < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if not self.max_entries:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
