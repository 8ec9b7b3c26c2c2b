"""The router's side of an upstream server's answer: passed on whole (with the headers a client
may act on), read for its OpenAI error, or relayed as a stream that ends cleanly even when the
server fails mid-stream."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ksana_llm.server.errors import engine_unavailable
from ksana_llm.server.native import NUL, STREAM_MEDIA_TYPE

logger = logging.getLogger("ksana_llm.router")


async def read_answer(response: httpx.Response) -> bytes:
    try:
        return await response.aread()
    finally:
        await response.aclose()


# Upstream headers a client may act on, passed on with the server's answer.
_PASSED_HEADERS = ("retry-after",)


def passed_on(response: httpx.Response, content: bytes) -> Response:
    """A server's whole answer as the router's."""
    headers = {k: response.headers[k] for k in _PASSED_HEADERS if k in response.headers}
    return Response(content, status_code=response.status_code, headers=headers,
                    media_type=response.headers.get("content-type"))


def _error_body(response: httpx.Response) -> dict[str, Any]:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return {}
    return error if isinstance(error, dict) else {}


def error_code(response: httpx.Response) -> str | None:
    return _error_body(response).get("code")


def error_param(response: httpx.Response) -> str | None:
    return _error_body(response).get("param")


def client_error(response: httpx.Response) -> bool:
    """Whether a prefill server's refusal is about the client's request (the decode server would
    refuse it the same way), not about the prefill server or its KV-transfer part. An unknown
    `model` is the prefill server's: decode servers may serve LoRA adapters it lacks."""
    if response.status_code not in (400, 404, 413):
        return False
    error = _error_body(response)
    return bool(error) and error.get("param") not in ("kv_transfer_params", "model")


SSE_MEDIA_TYPE = "text/event-stream"
_SSE_DONE = b"data: [DONE]\n\n"


def _stream_error(url: str, exc: httpx.HTTPError) -> bytes:
    """The OpenAI error body for a decode server lost mid-stream."""
    error = engine_unavailable(f"the decode server {url} failed mid-stream ({exc!r})")
    return json.dumps(error.body()).encode()


async def _relay_sse(upstream: httpx.Response, content: AsyncIterator[bytes]
                     ) -> AsyncIterator[bytes]:
    """An SSE stream passed on event by event; if the decode server fails mid-stream, the
    partial event is dropped and the stream ends as the servers' own do on an engine failure:
    an error event, then `data: [DONE]`."""
    pending = b""
    try:
        async for chunk in content:
            pending += chunk
            end = pending.rfind(b"\n\n") + 2
            if end > 1:
                yield pending[:end]
                pending = pending[end:]
    except httpx.HTTPError as exc:
        logger.warning("decode server %s failed mid-stream: %r", upstream.url, exc)
        yield b"data: " + _stream_error(str(upstream.url), exc) + b"\n\n" + _SSE_DONE
        return
    if pending:
        yield pending


async def _relay_native(upstream: httpx.Response, content: AsyncIterator[bytes]
                        ) -> AsyncIterator[bytes]:
    """A NUL-delimited /generate stream passed on; on a mid-stream failure it ends with an
    error chunk, as the server's own stream does on an engine failure."""
    ended = True  # the last byte passed on ended a chunk
    try:
        async for chunk in content:
            if chunk:
                ended = chunk.endswith(NUL)
            yield chunk
    except httpx.HTTPError as exc:
        logger.warning("decode server %s failed mid-stream: %r", upstream.url, exc)
        yield (b"" if ended else NUL) + _stream_error(str(upstream.url), exc) + NUL


def _relayed(upstream: httpx.Response, content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`content` as the client gets it. A stream's end is framed by its type; other bodies
    (a JSON answer) cannot say they were cut short, so their connection is just dropped."""
    media_type = upstream.headers.get("content-type", "").split(";")[0].strip()
    if media_type == SSE_MEDIA_TYPE:
        return _relay_sse(upstream, content)
    if media_type == STREAM_MEDIA_TYPE:
        return _relay_native(upstream, content)
    return content


class RelayedStream(StreamingResponse):
    """The decode server's stream, passed on; however it ends (done, or the client left), the
    connection to the decode server is closed, which aborts the request there. If the decode
    server fails mid-stream, the client's stream ends with an error event (see `_relayed`)."""

    def __init__(self, upstream: httpx.Response,
                 content: AsyncIterator[bytes] | None = None) -> None:
        super().__init__(_relayed(upstream, content or upstream.aiter_bytes()), status_code=200,
                         media_type=upstream.headers.get("content-type"),
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: after a disconnect this may run in a cancelled scope, where an
            # unshielded await would be cancelled before the connection is closed.
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()
