"""The router's `/v1/responses` routing: a Responses conversation stays on the decode server
that stored it. The router remembers which server answered each response id (the last
`MAX_REMEMBERED_RESPONSES`), sends a `previous_response_id` continuation and a stored response's
GET / DELETE (its input items, its cancel) there, and asks each decode server in turn for an id
it does not know (a continuation of one too); a server that refuses the connection is passed
over. Split from `server/router.py`; mixed into its `Router`."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import Response

from ksana_llm.server.router_failover import DecodeFailover
from ksana_llm.server.router_upstream import RelayedStream, passed_on, read_answer

# Response ids whose decode server the router remembers (the oldest are forgotten first).
MAX_REMEMBERED_RESPONSES = 65536
# The first id in a streamed response is the response's own (in `response.created`).
_RESPONSE_ID = re.compile(rb'"id": ?"(resp_[0-9A-Za-z]+)"')


class ResponsesRouting(DecodeFailover):
    """Mixed into `Router`, which provides `stats` and the `_response_servers` map (response
    id -> the decode server that stored it), and what `DecodeFailover` needs."""

    stats: Any
    _response_servers: OrderedDict[str, str]

    async def respond(self, body: dict[str, Any], request_id: str | None = None) -> Response:
        """A Responses request to the decode server holding its `previous_response_id`; one the
        router does not know (forgotten, or made on a server directly) to each server in turn
        until one has it; a new conversation to the next server, passed over when it refuses
        the connection. The answer's id is remembered with the server."""
        previous = body.get("previous_response_id")
        known = self._response_servers.get(previous) if isinstance(previous, str) else None
        self.stats.num_direct += 1
        server, response, content = await self._ask_each(
            [known] if known else self._servers_from_next(), "POST", "/v1/responses",
            json.dumps(body).encode(), "application/json", request_id)
        if content is None and body.get("stream") and response.status_code == 200:
            return RelayedStream(response, self._remember_streamed(response, server))
        content = content if content is not None else await read_answer(response)
        if response.status_code == 200:
            match = _RESPONSE_ID.search(content)
            if match:
                self._remember(match[1].decode(), server)
        return passed_on(response, content)

    async def _remember_streamed(self, response: httpx.Response, server: str
                                 ) -> AsyncIterator[bytes]:
        seen: bytes | None = b""
        async for chunk in response.aiter_bytes():
            if seen is not None:
                seen += chunk
                match = _RESPONSE_ID.search(seen)
                if match:
                    self._remember(match[1].decode(), server)
                if match or len(seen) > 2**16:
                    seen = None
            yield chunk

    def _remember(self, response_id: str, server: str) -> None:
        self._response_servers[response_id] = server
        self._response_servers.move_to_end(response_id)
        while len(self._response_servers) > MAX_REMEMBERED_RESPONSES:
            self._response_servers.popitem(last=False)

    async def stored_response(self, method: str, response_id: str, suffix: str = "",
                              query: str = "", request_id: str | None = None) -> Response:
        """GET or DELETE a stored response (or, with `suffix`, GET its "/input_items" or POST
        its "/cancel") on the server that holds it (one the router does not know: each decode
        server in turn, until one has it). A GET with `stream=true` (resuming a background
        response's events) is relayed as the stream it is."""
        known = self._response_servers.get(response_id)
        path = f"/v1/responses/{response_id}{suffix}" + (f"?{query}" if query else "")
        _, response, content = await self._ask_each(
            [known] if known else list(self.config.decode_urls), method, path, b"", None,
            request_id)
        if content is None and response.status_code == 200 and \
                response.headers.get("content-type", "").startswith("text/event-stream"):
            return RelayedStream(response)
        content = content if content is not None else await read_answer(response)
        if method == "DELETE" and response.status_code == 200:
            self._response_servers.pop(response_id, None)
        return passed_on(response, content)
