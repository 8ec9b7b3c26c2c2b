"""The router's control routes: the ones that are not a client's request to split between a
prefill and a decode server. `/v1/models` (and `/models`) is the first reachable decode
server's list, `/version` the router's own; `/health` (and
`/ping`) sums up every server's health; `/reset_prefix_cache`, `/update_weights_from_disk`,
`/sleep`, `/wake_up`, `/start_profile`, `/stop_profile`, `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` go to every server, prefill and decode alike, their answers gathered
by URL, `/is_sleeping` asks every one, and `/metrics` shows every server's metrics, labelled by
server (`server/router_metrics.py`).

Split from `server/router.py`, which routes each generation request to one server in turn:
these routes share only the router's HTTP client, upstream headers, server lists and counters.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import ksana_llm
from ksana_llm.server.errors import engine_unavailable
from ksana_llm.server.metrics import PROMETHEUS_TEXT_FORMAT
from ksana_llm.server.middleware import route_path
from ksana_llm.server.router_metrics import PROBE_TIMEOUT_S, merged_metrics, scrape_servers

if TYPE_CHECKING:
    from ksana_llm.server.router import Router, RouterConfig


# How long /health waits for each server's own /health.
HEALTH_TIMEOUT_S = 5.0


def request_id_of(request: Request) -> str | None:
    """The id RequestIdMiddleware gave this request (the client's X-Request-Id when usable)."""
    return request.scope.get("state", {}).get("request_id")


def add_control_routes(app: FastAPI, config: RouterConfig) -> None:
    """The routes above, on the router's `app` (whose `state.router` is its `Router`)."""

    @app.get("/v1/models")
    @app.get("/v1/models/{model:path}")
    @app.get("/models")  # KsanaLLM's spelling, as the servers answer it
    @app.get("/models/{model:path}")
    async def models(request: Request) -> Response:
        """The first decode server's answer that can be had (one that is down: the next)."""
        router: Router = request.app.state.router
        failures: list[str] = []
        for server in config.decode_urls:
            try:
                response = await router.client.get(server + route_path(request.scope),
                                                   headers=router.headers(request_id_of(request)))
            except httpx.HTTPError as exc:
                failures.append(f"{server}: {exc!r}")
                continue
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))
        raise engine_unavailable(f"no decode server can be reached ({'; '.join(failures)})")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": ksana_llm.__version__})

    @app.post("/reset_prefix_cache")
    @app.post("/update_weights_from_disk")
    @app.post("/sleep")
    @app.post("/wake_up")
    @app.post("/start_profile")
    @app.post("/stop_profile")
    @app.post("/v1/load_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def every_server(request: Request) -> JSONResponse:
        """The same request to every server (prefill and decode alike: a prefix cache to empty,
        new weights to load, sleep mode, profiling, LoRA adapters to load or unload): each server's answer by URL (its JSON, {} for a 200
        without any, its status code for an error, null when it could not be reached); 200
        when every server said 200, else 502."""
        router: Router = request.app.state.router
        headers = router.headers(request_id_of(request))
        content = await request.body()
        if content:
            headers["Content-Type"] = request.headers.get("content-type", "application/json")
        path = route_path(request.scope) + (f"?{request.url.query}" if request.url.query else "")
        servers = await _ask_every_server(router, config, "POST", path, headers, content)
        done = all(isinstance(answer, dict) for answer in servers.values())
        return JSONResponse({"servers": servers}, status_code=200 if done else 502)

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request) -> JSONResponse:
        """vLLM's sleep-mode probe over every server: `is_sleeping` is true while any server
        sleeps (the router cannot serve as usual until every one is awake), with each server's
        answer by URL (true / false, its status code for an error, null when unreachable);
        502 unless every server answered."""
        router: Router = request.app.state.router
        answers = await _ask_every_server(router, config, "GET", "/is_sleeping",
                                          router.headers(request_id_of(request)), b"")
        servers = {url: answer.get("is_sleeping") if isinstance(answer, dict) else answer
                   for url, answer in answers.items()}
        done = all(isinstance(asleep, bool) for asleep in servers.values())
        return JSONResponse({"is_sleeping": any(asleep is True for asleep in servers.values()),
                             "servers": servers}, status_code=200 if done else 502)

    @app.get("/load")
    async def load(request: Request) -> JSONResponse:
        """vLLM's server load, for a load balancer in front of this endpoint: the servers'
        `server_load` summed, with each one's by URL (its status code for an error, null when
        unreachable); 502 unless every server answered."""
        router: Router = request.app.state.router
        answers = await _ask_every_server(router, config, "GET", "/load",
                                          router.headers(request_id_of(request)), b"")
        servers = {url: answer.get("server_load") if isinstance(answer, dict) else answer
                   for url, answer in answers.items()}
        counts = [n for n in servers.values() if type(n) is int and n >= 0]
        return JSONResponse({"server_load": sum(counts), "servers": servers},
                            status_code=200 if len(counts) == len(servers) else 502)

    @app.get("/v1/stats")
    async def stats(request: Request) -> JSONResponse:
        """Every server's /v1/stats by URL (its status code for an error, null when
        unreachable) and this endpoint's own routing counts; 502 unless every server answered."""
        router: Router = request.app.state.router
        servers = await _ask_every_server(router, config, "GET", "/v1/stats",
                                          router.headers(request_id_of(request)), b"")
        counts = router.stats
        return JSONResponse({"servers": servers, "num_disaggregated": counts.num_disaggregated,
                             "num_direct": counts.num_direct,
                             "num_prefill_failures": counts.num_prefill_failures},
                            status_code=200 if all(isinstance(answer, dict)
                                                   for answer in servers.values()) else 502)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Every server's Prometheus metrics, each sample labelled with its server's URL."""
        router: Router = request.app.state.router
        pages, unreachable = await scrape_servers(
            router.client, config.prefill_urls + config.decode_urls,
            router.headers(request_id_of(request)))
        return Response(merged_metrics(pages, unreachable), media_type=PROMETHEUS_TEXT_FORMAT)

    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health(request: Request) -> JSONResponse:
        """Each server's /health status. 200 while a decode server is up (the router can answer:
        without prefill servers the decode servers compute prompts themselves), with status
        "healthy" (KsanaLLM's word) when every server is up, "degraded" when some are not; 503
        with no decode server."""
        router: Router = request.app.state.router

        async def status(url: str) -> tuple[str, int | None]:
            try:
                return url, (await router.client.get(url + "/health",
                                                     timeout=HEALTH_TIMEOUT_S)).status_code
            except httpx.HTTPError:
                return url, None

        # All at once: a frozen server costs the probe one timeout, not one per server.
        servers = dict(await asyncio.gather(
            *map(status, dict.fromkeys(config.prefill_urls + config.decode_urls))))
        ok = all(code == 200 for code in servers.values())
        serving = any(servers[url] == 200 for url in config.decode_urls)
        stats = router.stats
        return JSONResponse({"status": "healthy" if ok else "degraded", "servers": servers,
                             "num_disaggregated": stats.num_disaggregated,
                             "num_direct": stats.num_direct,
                             "num_prefill_failures": stats.num_prefill_failures},
                            status_code=200 if serving else 503)


async def _ask_every_server(router: Router, config: RouterConfig, method: str, path: str,
                            headers: dict[str, str], content: bytes) -> dict[str, Any]:
    """`method path` on every server at once: each one's answer by URL (its JSON, {} for a 200
    without any, its status code for an error, None when it could not be reached)."""
    # Actions have no time limit (a server loading a large checkpoint answers when it is done);
    # probes do: one frozen server must not wedge the load balancer polling /load.
    timeout = PROBE_TIMEOUT_S if method == "GET" else None

    async def ask(url: str) -> tuple[str, Any]:
        try:
            answer = await router.client.request(method, url + path, headers=headers,
                                                 content=content or None, timeout=timeout)
            return url, answer.json() if answer.status_code == 200 else answer.status_code
        except httpx.HTTPError:
            return url, None
        except ValueError:  # a 200 without JSON (vLLM's servers answer so): done
            return url, {}

    return dict(await asyncio.gather(
        *map(ask, dict.fromkeys(config.prefill_urls + config.decode_urls))))
