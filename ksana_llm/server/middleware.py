"""Pure ASGI middlewares: request ids, API-key check and request-body size limit; and CORS for
browsers.

They run before routing, so they guard every route (including ones other modules mount) and an
unauthenticated or oversized request never gets its body buffered or parsed.
"""

from __future__ import annotations

import argparse
import hmac
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ksana_llm.server.errors import (APIError, bad_request, body_too_large, count_failure,
                                     unauthorized)

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # as TGI's payload_limit: far above any sane prompt


async def _send_error(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    # Answered before routing, so the app's error handlers (which count failures) never see it.
    count_failure(scope.get("app"), error)
    await error.response()(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every path but `open_paths`, compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str,
                 open_paths: Collection[str] = ("/health", "/ping")) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self._open_paths:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization") or b""
        if not hmac.compare_digest(given, self._expected):
            await _send_error(unauthorized(), scope, receive, send)
            return
        await self.app(scope, receive, send)


# What a client's X-Request-Id may be to be echoed (a trace id, not a place to smuggle bytes
# into our logs and headers): visible ASCII, at most 256 characters.
_CLIENT_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,256}")
REQUEST_ID_HEADER = "x-request-id"


class RequestIdMiddleware:
    """Every response carries `x-request-id`, as OpenAI's do (the `openai` client exposes it
    as `_request_id`): the client's own `X-Request-Id` when it sent a usable one (vLLM's rule,
    so a trace id crosses the proxy), else a fresh one. Outermost, so refusals (401, 413) and
    CORS preflights carry it too; the 500 handler adds it itself (Starlette answers those from
    outside every middleware)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, REQUEST_ID_HEADER.encode())
        request_id = given if given is not None and _CLIENT_REQUEST_ID.fullmatch(given) \
            else uuid.uuid4().hex.encode()
        # For what answers from outside every middleware: the 500 handler (errors.py).
        scope.setdefault("state", {})["request_id"] = request_id.decode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != REQUEST_ID_HEADER.encode()]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER.encode(), request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


# The routes that ask the engine for work: what `GET /load` counts while they are answered.
WORK_ROUTES = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/score",
    "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/invocations", "/generate",
    "/forward", "/pooling"})


@dataclass
class ServerLoad:
    """HTTP requests to the work routes being answered now (vLLM's server load metric)."""

    in_flight: int = 0


class LoadTrackingMiddleware:
    """Counts the POSTs to `WORK_ROUTES` from their arrival until their answer (a stream's
    included) is sent or the client leaves: what vLLM's `GET /load` reports, for load
    balancers that route by it."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or \
                scope["path"].removeprefix(scope.get("root_path", "")) not in WORK_ROUTES:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1  # one event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


class BodyLimitMiddleware:
    """Reject bodies over `max_bytes` with 413: by Content-Length up front, and by counting the bytes
    actually received (a chunked upload has no Content-Length, and a client may lie).

    The body (at most `max_bytes`) is buffered and replayed to the app; later `receive` calls pass
    through, so the app still sees `http.disconnect` when the client goes away.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _send_error(bad_request("Invalid Content-Length header."), scope, receive, send)
                return
            if length > self.max_bytes:
                await _send_error(body_too_large(self.max_bytes), scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its whole request: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(body_too_large(self.max_bytes), scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            if pending:
                return pending.pop()
            return await receive()

        await self.app(scope, replay, send)


@dataclass(frozen=True)
class CorsSettings:
    """Cross-origin access for browser clients (vLLM's --allowed-origins, --allowed-methods,
    --allowed-headers, --allow-credentials; its defaults: any origin, no credentials)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def cors_from_args(args: argparse.Namespace) -> CorsSettings:
    defaults = CorsSettings()
    return CorsSettings(
        allowed_origins=tuple(getattr(args, "allowed_origins", None) or defaults.allowed_origins),
        allowed_methods=tuple(getattr(args, "allowed_methods", None) or defaults.allowed_methods),
        allowed_headers=tuple(getattr(args, "allowed_headers", None) or defaults.allowed_headers),
        allow_credentials=bool(getattr(args, "allow_credentials", False)))


def add_cors(app: FastAPI, cors: CorsSettings) -> None:
    """Add after the API-key check, so it is outside it: a browser's preflight (OPTIONS, which
    never carries the API key) is answered before the key is checked."""
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods),
                       allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials,
                       expose_headers=[REQUEST_ID_HEADER])  # browsers' scripts may read it
