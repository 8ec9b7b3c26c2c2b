"""New weights while serving (SGLang's route, mounted only with `serve --enable-weight-updates`:
it makes the server read a folder a client names).

    POST /update_weights_from_disk {"model_path": "/checkpoints/step-200"}

The folder holds a checkpoint of the served model's type (all of its tensors, or some); the
answer says how many tensors were loaded. A folder that does not fit is a 400 and changes
nothing (`Engine.update_weights`).
"""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from ksana_llm.api.engine import EngineDeadError
from ksana_llm.server.errors import APIError, bad_request, engine_unavailable
from ksana_llm.server.submission import parse_body
from ksana_llm.server.state import server_state

router = APIRouter()


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: Literal["auto"] | None = None  # SGLang's clients may send it; formats are detected
    # SGLang's: the prefix cache is always emptied (its KV came from the old weights).
    flush_cache: Literal[True] = True
    weight_version: str | None = None  # SGLang's: a label for the new weights, echoed back


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> JSONResponse:
    state = server_state(request)
    req = await parse_body(request, UpdateWeightsFromDiskRequest)
    state.check_alive()
    try:
        # Off the event loop: the engine thread reads the folder between two steps.
        count = await asyncio.to_thread(state.engine.update_weights, req.model_path)
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from exc
    except ValueError as exc:
        raise bad_request(str(exc), param="model_path") from exc
    except RuntimeError as exc:  # the check or the copy failed: the message says which
        raise APIError(500, str(exc), type="internal_error", code="weight_update_failed") from exc
    answer = {"success": True, "num_tensors": count,
              "message": f"Loaded {count} tensors from {req.model_path}; the prefix cache was "
                         "emptied."}
    if req.weight_version is not None:
        answer["weight_version"] = req.weight_version
    return JSONResponse(answer)
