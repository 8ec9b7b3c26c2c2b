"""User middlewares for `serve --middleware` (importable by path, as the flag takes them): each
stamps a header on every answer, so a test sees that both kinds ran."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

NOT_MIDDLEWARE = 42


class StampHeader:
    """A pure ASGI middleware class (added with app.add_middleware)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-stamp-class", b"1")]
            await send(message)

        await self.app(scope, receive, stamped)


async def stamp_function(request, call_next):
    """An `async (request, call_next)` function (added with app.middleware("http"))."""
    response = await call_next(request)
    response.headers["x-stamp-function"] = request.url.path
    return response
