"""`ksana-llm router`: one OpenAI endpoint in front of prefill servers and decode servers.

For each `/v1/completions` or `/v1/chat/completions` request the router
1. asks a prefill server (`serve --kv-role prefill`) for one token of it, with
   `kv_transfer_params: {"do_remote_decode": true}`: that server computes the prompt and keeps
   its KV under a transfer id;
2. sends the client's request, unchanged but for `kv_transfer_params` (the transfer id and the
   prefill server's URL), to a decode server (`serve --kv-role decode`), which fetches the KV,
   computes the last prompt token, generates, and answers (streamed or not) through the router.

Servers are taken in turn (round robin). Requests the split cannot help go straight to a
decode server, which then computes the prompt itself: several prompts in one completions
request, prompt log-probs (the decode server does not compute the imported rows), and KsanaLLM's
native `/generate` and `/forward` (and `/tokenize`, `/detokenize`, `/v1/embeddings`, `/score`,
`/rerank`, `/classify`), and
`/v1/responses`, which keep their conversations on the decode server that answered: the router
remembers which one, sends a `previous_response_id` continuation there, and looks stored
responses up there (or, for one it does not know, on each decode server:
server/router_responses.py; the failover over decode servers is server/router_failover.py).
So does every request when the prefill server is down, overloaded, failing or refuses the
KV-transfer part: slower, never lost. A prefill server's 400 about the request itself is the client's answer.
`/invocations` (SageMaker's) goes where its body's API would; `/reset_prefix_cache`,
`/update_weights_from_disk`, `/sleep`, `/wake_up`, `/start_profile` and `/stop_profile` go to
every server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

import ksana_llm
from ksana_llm.server.errors import (bad_request, engine_unavailable, install_error_handlers,
                                     malformed_json)
from ksana_llm.server.generation import finished_before_client_left
from ksana_llm.server.submission import CLIENT_CLOSED_REQUEST, LORA_NOT_TRANSFERABLE
from ksana_llm.server.listen import AnnouncingServer, uvicorn_config, uvicorn_tls_options
from ksana_llm.server.router_control import add_control_routes, request_id_of
from ksana_llm.server.router_responses import ResponsesRouting
from ksana_llm.server.router_upstream import (RelayedStream, client_error, error_code,
                                              error_param, passed_on, read_answer)
from ksana_llm.server.middleware import (DEFAULT_MAX_BODY_BYTES, REQUEST_ID_HEADER,
                                        ApiKeyMiddleware, BodyLimitMiddleware, CorsSettings,
                                        RequestIdMiddleware, add_cors, cors_from_args,
                                        route_path)

logger = logging.getLogger("ksana_llm.router")

# Routes sent straight to a decode server.
# /invocations: the API a body's key names (server/invocations.py's rule).
_INVOCATION_APIS = (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions"),
                    ("prompt_embeds", "/v1/completions"))
_DIRECT_PATHS = ("/generate", "/forward", "/tokenize", "/detokenize", "/v1/embeddings",
                 "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify",
                 "/v1/classify", "/pooling")


# What a prefill request keeps of the client's: what decides the prompt's tokens, and whose
# prefix cache they may share (cache_salt keeps one tenant's prompts out of another's there too).
_PROMPT_FIELDS = ("model", "prompt", "messages", "tools", "tool_choice", "parallel_tool_calls",
                  "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                  "documents", "add_special_tokens", "reasoning_effort", "truncate_prompt_tokens",
                  "cache_salt")

# A prefill server that timed out or could not be reached is passed over for this long: the
# requests meanwhile go straight to a decode server instead of each waiting out the timeout.
PREFILL_REST_S = 30.0
# Dropping a failed request's KV on its prefill server: a courtesy, never worth a long wait.
DISCARD_TIMEOUT_S = 5.0


@dataclass
class RouterConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    api_key: str | None = None  # checked on clients, and sent to the servers
    timeout_s: float = 600.0
    # The longest a prefill server may take for its one token (a prompt computed, queueing
    # included) before the decode server computes the prompt itself.
    prefill_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.decode_urls:
            raise ValueError("the router needs at least one --decode server")
        if not self.prefill_timeout_s > 0:
            raise ValueError(f"--prefill-timeout must be more than 0 seconds, got "
                             f"{self.prefill_timeout_s}")
        for url in self.prefill_urls + self.decode_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server URLs must start with http:// or https://, got {url!r}")
        self.prefill_urls = [u.rstrip("/") for u in self.prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in self.decode_urls]


@dataclass
class RouterStats:
    num_disaggregated: int = 0  # requests decoded from a prefill server's KV
    num_direct: int = 0  # requests a decode server computed alone
    num_prefill_failures: int = 0


@dataclass
class Router(ResponsesRouting):
    config: RouterConfig
    client: httpx.AsyncClient
    stats: RouterStats = field(default_factory=RouterStats)
    _prefill: Iterator[str] = field(init=False)
    _decode: Iterator[str] = field(init=False)
    # `model` names the prefill servers answered are LoRA adapters, whose KV does not transfer:
    # their requests go to a decode server whole, without asking a prefill server again.
    _adapters: set[str] = field(default_factory=set)
    # /v1/responses id -> the decode server that stored it.
    _response_servers: OrderedDict[str, str] = field(default_factory=OrderedDict)
    # Prefill server -> when (time.monotonic) it is asked again after a timeout or a refused
    # connection.
    _prefill_resting: dict[str, float] = field(default_factory=dict)
    # KV discards under way (a reference keeps each task alive until it ends).
    _discards: set[asyncio.Task] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._prefill = itertools.cycle(self.config.prefill_urls)
        self._decode = itertools.cycle(self.config.decode_urls)

    def headers(self, request_id: str | None = None) -> dict[str, str]:
        """What every upstream request carries: the servers' API key, and the client's request
        id, so one X-Request-Id names the request in the router's and the servers' answers."""
        key = self.config.api_key
        return {**({"Authorization": f"Bearer {key}"} if key else {}),
                **({REQUEST_ID_HEADER: request_id} if request_id else {})}

    async def prefill(self, path: str, body: dict[str, Any], request_id: str | None = None
                      ) -> dict[str, Any] | Response | None:
        """The decode server's `kv_transfer_params` from a prefill server; a Response to return
        as is (the request is bad); None to decode without it."""
        if not self.config.prefill_urls or not _disaggregable(path, body) \
                or body.get("model") in self._adapters:
            return None
        url = self._next_prefill_server()
        if url is None:
            return None  # every one is resting after a failure: the decode server computes it
        request = {k: body[k] for k in _PROMPT_FIELDS if k in body}
        transfer: dict[str, Any] = {"do_remote_decode": True}
        budget = _completion_budget(body)
        if budget is not None:
            # The prefill server refuses a prompt that leaves no room for it, before computing
            # it (and keeping KV nobody would fetch), in the words of the client's request.
            transfer["decode_max_tokens"] = budget
        request.update(max_tokens=1, temperature=0, kv_transfer_params=transfer)
        try:
            response = await self.client.post(url + path, json=request,
                                              headers=self.headers(request_id),
                                              timeout=self.config.prefill_timeout_s)
        except httpx.HTTPError as exc:
            if isinstance(exc, (httpx.TimeoutException, httpx.ConnectError)):
                self._prefill_resting[url] = time.monotonic() + PREFILL_REST_S
            return self._prefill_failed(url, repr(exc))
        if response.status_code != 200:
            if error_code(response) == LORA_NOT_TRANSFERABLE:
                self._adapters.add(body.get("model"))
                return None
            if error_param(response) == "model":
                # A model the prefill server does not serve: perhaps a decode server's LoRA
                # adapter. The decode server answers it whole; nothing failed.
                return None
            if error_code(response) == "context_length_exceeded":
                # The prefill server judged our one-token request: the decode server refuses
                # the client's own (before computing anything), in the client's numbers.
                return None
            if client_error(response):
                return passed_on(response, response.content)
            return self._prefill_failed(url, f"status {response.status_code}: {response.text[:200]}")
        try:
            answer = response.json()
        except ValueError:
            answer = None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            return self._prefill_failed(url, "no kv_transfer_params (started without --kv-role?)")
        return {**params, "remote_url": url}

    def _next_prefill_server(self) -> str | None:
        """The next prefill server in turn that is not resting after a failure (None: all are)."""
        now = time.monotonic()
        for _ in range(len(self.config.prefill_urls)):
            url = next(self._prefill)
            if self._prefill_resting.get(url, 0.0) <= now:
                self._prefill_resting.pop(url, None)
                return url
        return None

    def _discard_kv(self, params: dict[str, Any], request_id: str | None) -> None:
        """Tell the prefill server to drop KV kept for a request the decode side refused or
        never got (else it holds host memory, and may push out others' KV, until its TTL)."""
        url = f"{params['remote_url']}/kv_transfer/{params.get('transfer_id')}"

        async def discard() -> None:
            try:
                await self.client.delete(url, headers=self.headers(request_id),
                                         timeout=DISCARD_TIMEOUT_S)
            except httpx.HTTPError as exc:
                logger.info("could not drop the KV at %s (%r); it expires", url, exc)

        task = asyncio.ensure_future(discard())
        self._discards.add(task)
        task.add_done_callback(self._discards.discard)

    def _prefill_failed(self, url: str, why: str) -> None:
        self.stats.num_prefill_failures += 1
        logger.warning("prefill server %s failed (%s); the decode server computes the prompt", url, why)
        return None

    async def forward(self, path: str, body: dict[str, Any], request_id: str | None = None
                      ) -> Response:
        """The whole request through prefill (when it helps) and decode servers."""
        params = await self.prefill(path, body, request_id)
        if isinstance(params, Response):
            return params
        body = dict(body)
        body.pop("kv_transfer_params", None)
        if params is None:
            self.stats.num_direct += 1
        else:
            self.stats.num_disaggregated += 1
            body["kv_transfer_params"] = params
        fetched = False
        try:
            response = await self.decode(path, json.dumps(body).encode(), "application/json",
                                         stream=bool(body.get("stream")), request_id=request_id)
            # A 200 fetched the KV (or found it gone); a refusal came before any fetch.
            fetched = response.status_code == 200
            return response
        finally:
            if params is not None and not fetched:
                self._discard_kv(params, request_id)

    async def decode(self, path: str, content: bytes, content_type: str | None, *,
                     stream: bool, request_id: str | None = None) -> Response:
        """A request to the next decode server that takes it, its answer passed on (`stream`:
        as it comes)."""
        _, response, _ = await self._ask_each(self._servers_from_next(), "POST", path, content,
                                              content_type, request_id, next_on_404=False)
        if stream and response.status_code == 200:
            return RelayedStream(response)
        return passed_on(response, await read_answer(response))

    async def _send(self, server: str, path: str, content: bytes, content_type: str | None,
                    method: str = "POST", request_id: str | None = None,
                    pass_connect_errors: bool = False) -> httpx.Response:
        """`pass_connect_errors`: a refused connection raises httpx.ConnectError (for the caller
        to try another server) instead of the client's 503."""
        url = server + path
        headers = {**self.headers(request_id),
                   **({"Content-Type": content_type} if content_type else {})}
        request = self.client.build_request(method, url, content=content, headers=headers)
        try:
            return await self.client.send(request, stream=True)
        except httpx.ConnectError:
            if pass_connect_errors:
                raise
            raise engine_unavailable(f"decode server {url} cannot be reached") from None
        except httpx.HTTPError as exc:
            raise engine_unavailable(f"decode server {url} cannot be reached ({exc!r})") from exc


def _completion_budget(body: dict[str, Any]) -> int | None:
    """The completion tokens the client asks for (chat's max_completion_tokens first, as the
    servers read it), when it is a positive integer; anything else is the decode server's to
    judge."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None:
            is_count = isinstance(value, int) and not isinstance(value, bool) and value > 0
            return value if is_count else None
    return None


def _disaggregable(path: str, body: dict[str, Any]) -> bool:
    if body.get("prompt_logprobs") is not None or body.get("prompt_embeds") is not None:
        return False  # every prompt row computed here; embeddings' KV is never exported
    if path.endswith("/completions") and "messages" not in body:
        prompt = body.get("prompt")
        if body.get("echo") and body.get("logprobs") is not None:
            return False  # the prompt's own log-probs are wanted
        several = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        return not several or len(prompt) == 1
    return True


async def _unless_client_leaves(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s answer; if the client leaves first, `work` is cancelled, which closes its
    connections to the servers, and they abort the request."""
    task = asyncio.ensure_future(work)
    try:
        if not await finished_before_client_left(request, task):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return task.result()
    finally:
        task.cancel()


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, RecursionError) as exc:  # RecursionError: deep nesting
        raise malformed_json(exc) from exc
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def build_router_app(config: RouterConfig, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     cors: CorsSettings | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=config.timeout_s) as client:
            app.state.router = Router(config, client)
            yield

    app = FastAPI(title="ksana-llm router", version=ksana_llm.__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _unless_client_leaves(request, request.app.state.router.forward(
            "/v1/completions", await _json_body(request), request_id_of(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _unless_client_leaves(request, request.app.state.router.forward(
            "/v1/chat/completions", await _json_body(request), request_id_of(request)))

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's route: chat and completion bodies through prefill and decode servers
        like theirs; the rest (embeddings, scores, reranks, bad bodies) straight to a decode
        server, whose /invocations answers or refuses them."""
        body = await _json_body(request)
        api = {path for key, path in _INVOCATION_APIS if key in body}
        if len(api) == 1 and not any(key in body for key in ("input", "text_1", "documents")):
            return await _unless_client_leaves(request, request.app.state.router.forward(
                api.pop(), body, request_id_of(request)))
        return await direct(request)

    async def direct(request: Request) -> Response:
        """KsanaLLM's native routes and the tokenizer's: straight to a decode server, which
        computes the prompt (the body is passed on as it came: JSON or msgpack)."""
        router: Router = request.app.state.router
        router.stats.num_direct += 1
        work = router.decode(route_path(request.scope), await request.body(),
                             request.headers.get("content-type"), stream=True,
                             request_id=request_id_of(request))
        return await _unless_client_leaves(request, work)

    for path in _DIRECT_PATHS:
        app.add_api_route(path, direct, methods=["POST"])

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _unless_client_leaves(request, request.app.state.router.respond(
            await _json_body(request), request_id_of(request)))

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, request: Request) -> Response:
        return await request.app.state.router.stored_response(
            request.method, response_id, query=request.url.query,
            request_id=request_id_of(request))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        return await request.app.state.router.stored_response(
            "POST", response_id, "/cancel", request_id=request_id_of(request))

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request) -> Response:
        return await request.app.state.router.stored_response(
            "GET", response_id, "/input_items", request.url.query, request_id_of(request))

    # /v1/models, /health, and what every server must do (/reset_prefix_cache, /sleep, ...).
    add_control_routes(app, config)

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if cors is not None:
        add_cors(app, cors)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries its id
    return app


def run_router(args: argparse.Namespace) -> int:
    tls = uvicorn_tls_options(args.ssl_certfile, args.ssl_keyfile,
                              args.ssl_keyfile_password)
    app = build_router_app(RouterConfig(args.prefill, args.decode, api_key=args.api_key,
                                        prefill_timeout_s=args.prefill_timeout),
                           cors=cors_from_args(args))
    AnnouncingServer(uvicorn_config(app, args, tls), "routing to "
                     f"{len(args.prefill)} prefill and {len(args.decode)} decode servers").run()
    return 0
