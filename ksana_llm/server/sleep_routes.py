"""Sleep mode over HTTP (vLLM's routes, mounted when the engine has `enable_sleep_mode`, i.e.
`serve --enable-sleep-mode`):

    POST /sleep?level=1                       free the KV cache and the weights' device memory
    POST /wake_up[?tags=weights&tags=kv_cache] take it back (both parts without tags)
    GET  /is_sleeping                         {"is_sleeping": true|false}

Requests that arrive while the engine sleeps wait in its queue and run after it wakes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ksana_llm.api.engine import EngineDeadError
from ksana_llm.server.errors import bad_request, engine_unavailable
from ksana_llm.server.state import server_state

router = APIRouter()


@router.post("/sleep")
async def sleep(request: Request) -> Response:
    state = server_state(request)
    state.check_alive()
    raw = request.query_params.get("level", "1")
    try:
        level = int(raw)
    except ValueError:
        raise bad_request(f"level must be 1 or 2, got {raw!r}", param="level") from None
    await on_engine(lambda: state.engine.sleep(level), param="level")
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request) -> Response:
    state = server_state(request)
    state.check_alive()
    tags = request.query_params.getlist("tags") or None
    await on_engine(lambda: state.engine.wake_up(tags), param="tags")
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> JSONResponse:
    state = server_state(request)
    state.check_alive()
    asleep = await on_engine(state.engine.is_sleeping, param=None)
    return JSONResponse({"is_sleeping": asleep})


async def on_engine(work: Callable[[], Any], *, param: str | None) -> Any:
    """`work()` off the event loop (it waits for the engine thread); its ValueError is a 400
    (naming `param` when it is about that parameter)."""
    try:
        return await asyncio.to_thread(work)
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from exc
    except ValueError as exc:
        message = str(exc)
        raise bad_request(message, param=param if param and message.startswith(param) else None
                          ) from exc
