"""The router's `/v1/responses` routing: a Responses conversation stays on the decode server
that stored it. The router remembers which server answered each response id (the last
`MAX_REMEMBERED_RESPONSES`), sends a `previous_response_id` continuation and a stored response's
GET / DELETE (its input items, its cancel) there, and asks each decode server in turn for an id
it does not know (a continuation of one too); a server that refuses the connection is passed
over. Split from `server/router.py`; mixed into its `Router`."""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from fastapi.responses import Response

from ksana_llm.server.errors import engine_unavailable
from ksana_llm.server.router_upstream import RelayedStream, passed_on, read_answer

logger = logging.getLogger("ksana_llm.router")

# Response ids whose decode server the router remembers (the oldest are forgotten first).
MAX_REMEMBERED_RESPONSES = 65536
# The first id in a streamed response is the response's own (in `response.created`).
_RESPONSE_ID = re.compile(rb'"id": ?"(resp_[0-9A-Za-z]+)"')


class ResponsesRouting:
    """Mixed into `Router`, which provides `config`, `stats`, `_decode`, `_send` and the
    `_response_servers` map (response id -> the decode server that stored it)."""

    config: Any
    stats: Any
    _decode: Iterator[str]
    _response_servers: OrderedDict[str, str]

    async def _send(self, server: str, path: str, content: bytes, content_type: str | None,
                    method: str = "POST", request_id: str | None = None,
                    pass_connect_errors: bool = False) -> httpx.Response:  # pragma: no cover
        raise NotImplementedError

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

    def _servers_from_next(self) -> list[str]:
        """Every decode server, the next in the rotation first."""
        first = next(self._decode)
        urls = list(self.config.decode_urls)
        at = urls.index(first)
        return urls[at:] + urls[:at]

    async def _ask_each(self, servers: list[str], method: str, path: str, content: bytes,
                        content_type: str | None, request_id: str | None,
                        next_on_404: bool = True) -> tuple[str, httpx.Response, bytes | None]:
        """The first of `servers` to answer (other than 404, with `next_on_404`): (server, its
        response unread, None); a server that refuses the connection never got the request
        and is passed over (one server down does not fail its turn's share of the requests;
        any other failure is the client's 503: the request may have reached the server). When
        every one that answered said 404: the last of those, read. None reachable: a 503."""
        refused: list[str] = []
        not_found: tuple[str, httpx.Response, bytes | None] | None = None
        for server in servers:
            try:
                response = await self._send(server, path, content, content_type, method=method,
                                            request_id=request_id, pass_connect_errors=True)
            except httpx.ConnectError as exc:
                logger.warning("decode server %s cannot be reached (%r); trying the next one",
                               server, exc)
                refused.append(server)
                continue
            if response.status_code != 404 or not next_on_404:
                return server, response, None
            not_found = (server, response, await read_answer(response))
        if not_found is not None:
            return not_found
        raise engine_unavailable(f"no decode server can be reached (refused: "
                                 f"{', '.join(refused)})")

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
