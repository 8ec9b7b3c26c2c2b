"""Loading and unloading LoRA adapters while serving (vLLM's routes, mounted only with
`serve --allow-runtime-lora-updating`: they make the server read folders a client names).

    POST /v1/load_lora_adapter   {"lora_name": "sql", "lora_path": "/adapters/sql"}
                                 (+ "load_inplace": true to replace a loaded "sql")
    POST /v1/unload_lora_adapter {"lora_name": "sql"}

A loaded adapter is served under its name (`model`) and listed by /v1/models.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ksana_llm.api.engine import EngineDeadError
from ksana_llm.server.errors import APIError, bad_request, engine_unavailable
from ksana_llm.server.submission import parse_body
from ksana_llm.server.state import server_state

router = APIRouter()


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    # vLLM's: replace the adapter loaded under lora_name (an RL trainer's new checkpoint).
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; names identify adapters here


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = server_state(request)
    req = await parse_body(request, LoadLoraAdapterRequest)
    state.check_alive()
    if req.lora_name in (state.served_model_name, *state.model_aliases):
        raise bad_request(f"The adapter name {req.lora_name!r} is the served model's.",
                          param="lora_name")
    if req.lora_name in state.engine.lora_adapters and not req.load_inplace:
        raise bad_request(f"The LoRA adapter {req.lora_name!r} has already been loaded. To "
                          "replace it, set 'load_inplace' to true.", param="lora_name")
    try:
        # Off the event loop: it waits for the engine thread, which reads the files between
        # two steps.
        await asyncio.to_thread(state.engine.load_lora_adapter, req.lora_name, req.lora_path,
                                load_inplace=req.load_inplace)
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from exc
    except ValueError as exc:
        message = str(exc)
        param = "lora_name" if message.startswith("lora_name") else (
            "lora_path" if message.startswith("LoRA adapter") else None)
        raise bad_request(message, param=param) from exc
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = server_state(request)
    req = await parse_body(request, UnloadLoraAdapterRequest)
    state.check_alive()
    if req.lora_name not in state.engine.lora_adapters:
        raise APIError(404, f"The LoRA adapter {req.lora_name!r} cannot be found.",
                       param="lora_name", code="lora_adapter_not_found")
    try:
        await asyncio.to_thread(state.engine.unload_lora_adapter, req.lora_name)
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from exc
    except ValueError as exc:
        raise bad_request(str(exc), param="lora_name") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
