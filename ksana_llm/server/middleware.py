"""Pure ASGI middlewares: request ids, API-key check and request-body size limit; CORS for
browsers; and the user's own (`--middleware`).

They run before routing, so they guard every route (including ones other modules mount) and an
unauthenticated or oversized request never gets its body buffered or parsed.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import inspect
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ksana_llm.import_path import import_by_path
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


def route_path(scope: Scope) -> str:
    """The request's path as the routes see it: uvicorn puts `--root-path` in front of
    `scope["path"]` (the ASGI rule), and Starlette's router takes it off again."""
    return scope["path"].removeprefix(scope.get("root_path", ""))


# Paths answered without the API key: liveness probes, and Prometheus' scrape (vLLM and SGLang
# leave /metrics open too, so a stock scrape config keeps working when a key is set).
OPEN_PATHS = ("/health", "/ping", "/metrics")


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every path but `open_paths`, compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str,
                 open_paths: Collection[str] = OPEN_PATHS) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in self._open_paths:
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
    "/forward", "/classify", "/v1/classify", "/pooling"})


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
                route_path(scope) not in WORK_ROUTES:
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


CLIENT_GONE = "ksana_llm.client_gone"  # the scope key of DisconnectWatchMiddleware's event


class DisconnectWatchMiddleware:
    """Notes in the scope (an asyncio.Event under CLIENT_GONE) when the client disconnects.

    Once the request's body is complete, the only message left on the connection is the
    disconnect: a task waits for it at once, and hands it on to whoever asks next. Without
    this, a function middleware (`--middleware`, run by Starlette's BaseHTTPMiddleware) hides
    the disconnect from `Request.is_disconnected`, and a non-streaming request whose client
    left would run to its end."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gone = scope[CLIENT_GONE] = asyncio.Event()
        last: asyncio.Future[Message] | None = None

        async def wait_for_disconnect() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            return message

        async def watched_receive() -> Message:
            nonlocal last
            if last is not None:  # the body is complete: the watching task has the next one
                message = await asyncio.shield(last)
                if message["type"] != "http.disconnect":
                    last = None  # handed on once; a disconnect is the answer from then on
                return message
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                last = asyncio.ensure_future(wait_for_disconnect())
            return message

        try:
            await self.app(scope, watched_receive, send)
        finally:
            if last is not None:
                if last.done():
                    if not last.cancelled():
                        last.exception()  # read, so asyncio does not log it as never retrieved
                else:
                    last.cancel()


def client_gone(scope: Scope) -> bool:
    """Whether DisconnectWatchMiddleware saw this request's client disconnect."""
    event = scope.get(CLIENT_GONE)
    return event is not None and event.is_set()


def user_middlewares(specs: Collection[str | object] | None) -> tuple[object, ...]:
    """vLLM's `--middleware`: each an import path ('module:name' or 'module.name') to an ASGI
    middleware class (added with `app.add_middleware`) or an `async def (request, call_next)`
    function (added with `app.middleware("http")`), or the object itself. A ValueError naming
    `--middleware` says which entry cannot be used, before anything is loaded."""
    found = []
    for spec in specs or ():
        target = import_by_path(spec, "--middleware") if isinstance(spec, str) else spec
        if not (inspect.isclass(target) or inspect.iscoroutinefunction(target)):
            raise ValueError(f"--middleware {spec!s}: not an ASGI middleware class or an async "
                             f"function (request, call_next), but {type(target).__name__}")
        found.append(target)
    return tuple(found)


def add_user_middlewares(app: FastAPI, middlewares: Collection[object]) -> None:
    """Add `user_middlewares`' results in order (the last one added is the outermost)."""
    for middleware in middlewares:
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
