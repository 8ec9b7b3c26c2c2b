"""The router's decode-server failover: which decode servers to try, in what order, and what
counts as "try the next one". Used for every request that goes straight to a decode server
(`Router.decode`) and for `/v1/responses` (server/router_responses.py). Mixed into `Router`
(server/router.py), which sends the requests."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx

from ksana_llm.server.errors import engine_unavailable
from ksana_llm.server.router_upstream import read_answer

logger = logging.getLogger("ksana_llm.router")


class DecodeFailover:
    """Mixed into `Router`, which provides `config` (its `decode_urls`), `_decode` (the round
    robin over them) and `_send`."""

    config: Any
    _decode: Iterator[str]

    async def _send(self, server: str, path: str, content: bytes, content_type: str | None,
                    method: str = "POST", request_id: str | None = None,
                    pass_connect_errors: bool = False) -> httpx.Response:  # pragma: no cover
        raise NotImplementedError

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
