"""OpenAI-shaped errors: one exception type for the routes, and handlers that turn every failure
(ours, pydantic's, Starlette's) into `{"error": {"message", "type", "param", "code"}}`.

Client mistakes must never surface as 422 or 5xx, so FastAPI's own validation error is mapped to
400 here as well.
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("ksana_llm.server")

# Seconds a client should wait after a 429 (queue full); short, since a slot frees per finished request.
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error the client sees as-is: HTTP status plus the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None,
                 failure_reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        # The metrics' request_failure_total label, where the status alone does not tell it
        # (a 503 is "engine_error" unless it is a waiting timeout).
        self.failure_reason = failure_reason

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def no_tokenizer(field: str) -> APIError:
    """A request part given as text (or asking for text) on a server without a tokenizer."""
    return bad_request(f"`{field}` needs a tokenizer, and this server runs without one "
                       "(--skip-tokenizer-init): give token ids", param=field,
                       code="no_tokenizer")


def unauthorized() -> APIError:
    return APIError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                    type="authentication_error", code="invalid_api_key")


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than the limit of {limit} bytes.",
                    code="request_too_large")


def queue_full(detail: str) -> APIError:
    return APIError(429, f"The server is overloaded: {detail}", type="rate_limit_error",
                    code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


def engine_unavailable(detail: str = "the engine is not running") -> APIError:
    return APIError(503, f"Service unavailable: {detail}", type="service_unavailable",
                    code="engine_unavailable")


def internal_error(detail: str, code: str) -> APIError:
    """The server's own fault, said to the client (e.g. one of its logits processors failed)."""
    return APIError(500, f"Internal server error: {detail}", type="internal_error", code=code)


def waiting_timeout(detail: str) -> APIError:
    """A request never scheduled within --waiting-timeout-ms: the 503 of an unavailable
    engine (the client's answer is the same), counted as "timeout"."""
    error = engine_unavailable(detail)
    error.failure_reason = "timeout"
    return error


def malformed_json(detail: object) -> APIError:
    """A body that does not parse as JSON: the same 400 from every route (and the router)."""
    return bad_request(f"Malformed JSON body: {detail}", code="invalid_json")


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field (dotted path)."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return malformed_json(first.get("msg", ""))
    loc = _field_path(first)
    param = ".".join(loc) or None
    if first.get("type") == "model_type" and not loc:
        return bad_request("The request body must be a JSON object.")
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unknown parameter `{param}`.", param=param, code="unknown_parameter")
    # A union field fails once per member, each error tagged with the member's type: say what
    # every member wanted ("a valid string or a valid list"), under the field's own name.
    messages = [e.get("msg", "invalid value") for e in errors if _field_path(e) == loc]
    message = " or ".join(dict.fromkeys(messages))
    return bad_request(f"Invalid value for `{param}`: {message}." if param else f"{message}.",
                       param=param)


# Union-member tags pydantic puts in an error's location: "str", "list[str]", "bool",
# "literal['never']", "function-after[...]", or a model's class name (request fields are
# snake_case, so a capitalised entry is a tag).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "none"})


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and bool(part) and (
        part in _TYPE_TAGS or "[" in part or "-" in part or part[0].isupper())


def _field_path(error: Any) -> list[str]:
    """The error's location as the client's field path: no "body" prefix, no union tags."""
    return [str(p) for p in error.get("loc", ()) if p != "body" and not _is_union_tag(p)]


# Failure reasons as the metrics module labels them: a body too large is the client's request
# at fault, as a 400 is.
_FAILURE_REASON = MappingProxyType({400: "invalid_request", 404: "invalid_request",
                                    413: "invalid_request", 401: "unauthorized",
                                    429: "queue_full", 503: "engine_error"})


def failure_reason(error: APIError) -> str:
    """The request_failure_total label of an error."""
    return error.failure_reason or _FAILURE_REASON.get(error.status, "other")


def count_failure(app: Any, error: APIError) -> None:
    """Count `error` in the metrics of the server `app` serves (a router has none)."""
    state = getattr(getattr(app, "state", None), "server", None)
    if state is not None:
        state.count_failure(failure_reason(error))


def _count(request: Request, error: APIError) -> JSONResponse:
    count_failure(request.app, error)
    return error.response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _count(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _count(request, from_validation_error(exc))

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return _count(request, from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:  # no such route: OpenAI's wording
            message = f"Invalid URL ({request.method} {request.url.path})"
        return JSONResponse(error_body(message, "invalid_request_error"),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # Details go to the log, not to the client (they may hold paths or prompts); the
        # request id ties the two together.
        request_id = request.scope.get("state", {}).get("request_id")
        logger.exception("unhandled error while serving request %s", request_id)
        state = getattr(request.app.state, "server", None)
        if state is not None:
            state.count_failure("other")
        return JSONResponse(error_body("Internal server error.", "internal_error"), status_code=500,
                            headers={"x-request-id": request_id} if request_id else None)
