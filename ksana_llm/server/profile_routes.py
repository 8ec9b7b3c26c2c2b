"""Profiling over HTTP (vLLM's routes, mounted when the engine has a `profiler_config`, i.e.
`serve --profiler-config` or VLLM_TORCH_PROFILER_DIR):

    POST /start_profile     start tracing the engine's steps (torch.profiler)
    POST /stop_profile      stop, and write the trace: {"trace": "<path on the server>"}
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ksana_llm.server.sleep_routes import on_engine
from ksana_llm.server.state import server_state

router = APIRouter()


@router.post("/start_profile")
async def start_profile(request: Request) -> Response:
    state = server_state(request)
    state.check_alive()
    await on_engine(state.engine.start_profile, param=None)
    return Response(status_code=200)


@router.post("/stop_profile")
async def stop_profile(request: Request) -> JSONResponse:
    state = server_state(request)
    state.check_alive()
    return JSONResponse({"trace": await on_engine(state.engine.stop_profile, param=None)})
