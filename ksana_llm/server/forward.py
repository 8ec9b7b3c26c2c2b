"""KsanaLLM's native `POST /forward`: one forward pass per prompt, no sampling (ksana-notes §1).

Body: msgpack when `Content-Type: application/x-msgpack` (the response is msgpack too), else JSON.

Request: `{"requests": [{"prompt" | "input_tokens", "request_target": [{"target_name": "logits" |
"layernorm", "slice_pos": [[start, end], ...], "token_reduce_mode": "GATHER_ALL" |
"GATHER_TOKEN_ID", "token_id": [int], "input_top_logprobs_num": int, "token_logprobs": bool}]}]}`.
`slice_pos` ranges are inclusive, negatives count from the end; absent or [] = every position.
KsanaLLM's semantics (`api.forward_targets`): `logits` + GATHER_TOKEN_ID is the probability of the
next prompt token at each position (1-D; their PPL request), `layernorm` + `token_id` the rows of
the positions holding those ids. Extensions: `token_id` on `logits` (those vocabulary entries) and
`token_logprobs` (the log-prob of the next prompt token at each row, null at the last position).

Response: `{"responses": [{"input_token_ids", "input_top_logprobs", "response": [{"target_name",
"tensor": {"data", "shape", "dtype": "float32"}, ["token_logprobs"]}]}], "message": "", "code": 0}`.
`tensor.data` is base64 of the raw little-endian float32 bytes, in JSON *and* in msgpack (as
KsanaLLM's own clients decode it). `input_top_logprobs[t][row]` is the top-N `[token_id, logprob]`
list of target t's row (`[]` for targets that did not ask).

Errors are the other routes' OpenAI-shaped bodies, msgpack-packed for a msgpack request (as
KsanaLLM's client unpacks every answer): 400 bad input
(`param` names the field, e.g. `requests.0.request_target.1.slice_pos`), 429 queue full, 503
engine dead or shutting down; a client that disconnects aborts its requests.
"""

from __future__ import annotations

import asyncio
import base64
import re
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ksana_llm.api.forward_targets import resolve_target
from ksana_llm.api.forward_outputs import ForwardHandle, ForwardOutput, ForwardTarget
from ksana_llm.server.errors import APIError, bad_request, count_failure, from_validation_error
from ksana_llm.server.generation import run_forward
from ksana_llm.server.json_body import load_json
from ksana_llm.server.logprobs import _finite
from ksana_llm.server.submission import CLIENT_CLOSED_REQUEST
from ksana_llm.server.params import check_logprobs_cap, check_token_ids, prompt_token_lists
from ksana_llm.server.state import server_state

MSGPACK = "application/x-msgpack"
MAX_FORWARD_REQUESTS = 256  # prompts per body
# Numbers one response may carry (rows x width, all targets of all prompts): 2**24 float32 is
# 64 MB of tensors, ~90 MB of base64, and ~370 MB at the serving peak (the tensors, their bytes,
# base64 and the serialised body side by side). Without it a 40 KB body asking for every
# position's logits could take the server's whole memory.
MAX_FORWARD_VALUES = 1 << 24
_UNSUPPORTED_TARGETS = ("transformer", "lm_head")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TargetBody(_Strict):
    target_name: str
    token_id: list[int] = Field(default_factory=list)
    slice_pos: list[list[int]] = Field(default_factory=list)
    token_reduce_mode: str = "GATHER_ALL"
    input_top_logprobs_num: int = Field(0, ge=0, le=1000)
    token_logprobs: bool = False  # extension: next-token log-probs (PPL)


class ForwardRequestBody(_Strict):
    prompt: str | None = None
    input_tokens: list[int] | None = None
    request_target: list[TargetBody] = Field(min_length=1)


class ForwardBody(_Strict):
    requests: list[ForwardRequestBody] = Field(min_length=1, max_length=MAX_FORWARD_REQUESTS)
    model_name: str = ""  # accepted, as on /generate; one model is served


def _decode(raw: bytes, is_msgpack: bool) -> Any:
    try:
        if is_msgpack:
            return msgpack.unpackb(raw, raw=False, strict_map_key=True)
        return load_json(raw)
    # RecursionError: arrays nested past the JSON decoder's recursion limit
    except (ValueError, UnicodeDecodeError, RecursionError, msgpack.UnpackException) as exc:
        kind = "msgpack" if is_msgpack else "JSON"
        # (Some unpacker errors have no message: their kind says it.)
        raise bad_request(f"Malformed {kind} body: {str(exc) or type(exc).__name__}",
                          code="invalid_body") from exc


def _targets_param(i: int, message: str) -> tuple[str, str | None]:
    """An engine message "targets[j].field ..." -> (client message, param) in the body's names."""
    m = re.match(r"targets\[(\d+)\](?:\.(\w+))?", message)
    if m is None:
        return message, None
    param = f"requests.{i}.request_target.{m.group(1)}" + (f".{m.group(2)}" if m.group(2) else "")
    return param + message[m.end():], param


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().to(torch.float32).contiguous()
    data = t.numpy().astype("<f4", copy=False).tobytes()
    return {"data": base64.b64encode(data).decode("ascii"), "shape": list(t.shape), "dtype": "float32"}


def _nan_to_none(values: list[float]) -> list[float | None]:
    """NaN (no next token) -> null; -inf -> -9999.0 as in the logprobs of the other routes."""
    return [None if v != v else _finite(v) for v in values]


def _response_item(out: ForwardOutput, targets: list[TargetBody]) -> dict[str, Any]:
    items, top = [], []
    for target, got in zip(targets, out.targets):
        item: dict[str, Any] = {"target_name": got.target_name, "tensor": _tensor(got.tensor)}
        if got.token_logprobs is not None:
            item["token_logprobs"] = _nan_to_none(got.token_logprobs.tolist())
        items.append(item)
        top.append([[[int(i), _finite(float(lp))] for i, lp in row] for row in got.top_logprobs]
                   if got.top_logprobs is not None else [])
    return {"input_token_ids": out.prompt_token_ids, "input_top_logprobs": top, "response": items}


def _prompt_ids(i: int, req: ForwardRequestBody, state: Any) -> list[int]:
    if (req.prompt is None) == (req.input_tokens is None):
        raise bad_request("Give exactly one of `prompt` and `input_tokens`.",
                          param=f"requests.{i}.prompt")
    if req.prompt is not None:
        try:
            return prompt_token_lists(req.prompt, state.tokenizer, state.limits)[0]
        except APIError as exc:
            exc.param = f"requests.{i}.prompt"
            raise
    if not req.input_tokens:
        raise bad_request("The prompt is empty.", param=f"requests.{i}.input_tokens",
                          code="empty_prompt")
    check_token_ids(req.input_tokens, state.limits.vocab_size, f"requests.{i}.input_tokens")
    return list(req.input_tokens)


def _target_values(target: TargetBody, rows: int, vocab: int, hidden: int) -> int:
    """How many numbers the target returns: its tensor, its top log-probs ([id, logprob] pairs)
    and its next-token log-probs."""
    if target.target_name == "layernorm":
        return rows * hidden
    if target.token_reduce_mode != "GATHER_TOKEN_ID":
        width = vocab
    else:  # a column per token id (our extension), or the next token's probability
        width = len(target.token_id) or 1
    return rows * (width + 2 * target.input_top_logprobs_num + int(target.token_logprobs))


def _engine_target(t: TargetBody) -> ForwardTarget:
    return ForwardTarget(t.target_name, slice_pos=t.slice_pos or None,
                         token_id=t.token_id or None, token_reduce_mode=t.token_reduce_mode,
                         input_top_logprobs_num=t.input_top_logprobs_num,
                         token_logprobs=t.token_logprobs)


def _count_values(req: ForwardRequestBody, targets: list[ForwardTarget], ids: list[int],
                  engine: Any) -> int:
    """Numbers the request's targets return; ValueError (as the engine's) for a bad target."""
    config = engine.model.hf_config
    vocab, hidden = int(config.vocab_size), int(config.hidden_size)
    total = 0
    for j, (body_target, target) in enumerate(zip(req.request_target, targets)):
        _, positions = resolve_target(j, target, ids, vocab)
        total += _target_values(body_target, len(positions), vocab, hidden)
    return total


def _plan(engine: Any, body: ForwardBody, state: Any
          ) -> list[tuple[list[int], list[ForwardTarget]]]:
    """Every request's prompt ids and targets, all validated before anything is submitted."""
    jobs = []
    values = 0
    for i, req in enumerate(body.requests):
        ids = _prompt_ids(i, req, state)
        for j, t in enumerate(req.request_target):
            check_logprobs_cap(t.input_top_logprobs_num, state.max_logprobs,
                               f"requests.{i}.request_target.{j}.input_top_logprobs_num",
                               state.limits.vocab_size)
            if t.target_name in _UNSUPPORTED_TARGETS:
                raise bad_request(f"target_name {t.target_name!r} is not supported yet "
                                  "(supported: logits, layernorm).",
                                  param=f"requests.{i}.request_target.{j}.target_name",
                                  code="unsupported_parameter")
        targets = [_engine_target(t) for t in req.request_target]
        try:
            values += _count_values(req, targets, ids, engine)
        except ValueError as exc:
            message, param = _targets_param(i, str(exc))
            raise bad_request(message, param=param) from exc
        if values > MAX_FORWARD_VALUES:
            raise bad_request(
                f"The response would hold over {MAX_FORWARD_VALUES} numbers (rows x width "
                f"over every target; the logits are {state.limits.vocab_size} wide). Ask for "
                "fewer positions (`slice_pos`), GATHER_TOKEN_ID, top log-probs or "
                "`token_logprobs`, or split the request.",
                param=f"requests.{i}.request_target", code="forward_too_large")
        jobs.append((ids, targets))
    return jobs


def _submitter(engine: Any, body: ForwardBody, jobs: list[tuple[list[int], list[ForwardTarget]]],
               loop: asyncio.AbstractEventLoop) -> Callable[[int], ForwardHandle]:
    """What queues request i (an engine refusal of its input is a 400 naming the field)."""
    base = f"fwd-{uuid.uuid4().hex}"

    def submit(i: int) -> ForwardHandle:
        ids, targets = jobs[i]
        try:
            return engine.submit_forward(ids, targets, request_id=f"{base}-{i}", loop=loop)
        except ValueError as exc:
            message, param = _targets_param(i, str(exc))
            if param is None and str(exc).startswith("prompt"):
                given = "prompt" if body.requests[i].prompt is not None else "input_tokens"
                param = f"requests.{i}.{given}"
            raise bad_request(message, param=param) from exc

    return submit


def _is_msgpack(content_type: str, raw: bytes) -> bool:
    """Whether the body is msgpack: said so by its Content-Type (any of msgpack's names), or,
    with none that says JSON, unless it starts as JSON's object or array does (`{` or `[`
    after any whitespace, as curl's default form Content-Type carries JSON): KsanaLLM's
    clients send msgpack by default, so a body that is neither is answered, its error
    included, in msgpack."""
    kind = content_type.split(";")[0].strip().lower()
    if kind in (MSGPACK, "application/msgpack", "application/vnd.msgpack"):
        return True
    if kind == "application/json" or kind.startswith("text/"):
        return False
    return not raw.lstrip(b" \t\r\n").startswith((b"{", b"["))


async def forward(request: Request) -> Response:
    raw = await request.body()
    is_msgpack = _is_msgpack(request.headers.get("content-type", ""), raw)
    try:
        return await _forward(request, raw, is_msgpack)
    except APIError as error:
        if not is_msgpack:
            raise  # the app's handlers answer (and count) it
        # The error in the request's own encoding: KsanaLLM's client unpacks every answer.
        count_failure(request.app, error)
        return Response(msgpack.packb(error.body(), use_bin_type=True), status_code=error.status,
                        headers=error.headers, media_type=MSGPACK)


async def _forward(request: Request, raw: bytes, is_msgpack: bool) -> Response:
    state = server_state(request)
    data = _decode(raw, is_msgpack)
    if not isinstance(data, dict):
        raise bad_request("The request body must be an object.")
    if "requests" in data and isinstance(data["requests"], list):
        for i, req in enumerate(data["requests"]):
            if isinstance(req, dict) and "input_refit_embedding" in req:
                raise bad_request("Unsupported parameter(s): input_refit_embedding.",
                                  param=f"requests.{i}.input_refit_embedding",
                                  code="unsupported_parameter")
    try:
        body = ForwardBody.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
    state.check_alive()
    jobs = _plan(state.engine, body, state)
    submit = _submitter(state.engine, body, jobs, asyncio.get_running_loop())
    # Queued as the queue allows: a body may hold more requests than the queue.
    outputs = await run_forward(state.engine, submit, len(jobs), request)
    state.count_forward_outputs(outputs)
    if outputs is None:  # the client left; its requests were aborted
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    payload = {"responses": [_response_item(out, req.request_target)
                             for out, req in zip(outputs, body.requests)],
               "message": "", "code": 0}
    if is_msgpack:
        return Response(msgpack.packb(payload, use_bin_type=True), media_type=MSGPACK)
    return JSONResponse(payload)


def mount(app: FastAPI) -> None:
    """Called by `build_app` next to the native /generate router."""
    app.add_api_route("/forward", forward, methods=["POST"], include_in_schema=True)
