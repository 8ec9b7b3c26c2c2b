"""The router passes each request's id on to the servers behind it, so one X-Request-Id names
the request in the router's answer and in every server's log and answer; and it sends
/reset_prefix_cache and /update_weights_from_disk to every server.

The servers here are a real HTTP server on 127.0.0.1 that records what it is sent and answers
as a prefill and decode server would: what the router sends upstream cannot be seen from a real
server's answer (the router stamps its own id on what it passes on)."""

from __future__ import annotations

import http.server
import json
from dataclasses import dataclass

import httpx
import pytest

from tests.server_process import ServerProcess, free_port, stub_http_server


class _Recording(http.server.BaseHTTPRequestHandler):
    """Answers /health, prefill requests (with kv_transfer_params), decode requests, stored
    responses and /v1/models; records (method, path, X-Request-Id) of each request in `seen`."""

    seen: list[tuple[str, str, str | None]] = []
    bodies: list[dict] = []  # the JSON bodies of POSTs, in order

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path != "/health":
            self.seen.append((self.command, self.path, self.headers.get("X-Request-Id")))
        self._answer({"object": "list", "data": []})

    do_DELETE = do_GET  # noqa: N815

    def do_POST(self) -> None:  # noqa: N802
        content = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        request = json.loads(content) if content else {}
        self.seen.append(("POST", self.path, self.headers.get("X-Request-Id")))
        self.bodies.append(request)
        if request.get("kv_transfer_params", {}).get("do_remote_decode"):
            self._answer({"kv_transfer_params": {"transfer_id": "0" * 32}})
        else:
            self._answer({"id": "resp_1", "object": "response", "choices": []})

    def log_message(self, *args) -> None:
        pass


@dataclass
class _Upstream:
    url: str
    seen: list[tuple[str, str, str | None]]
    bodies: list[dict]


@pytest.fixture(scope="module")
def upstream():
    with stub_http_server(_Recording) as url:
        yield _Upstream(url, _Recording.seen, _Recording.bodies)


@pytest.fixture(scope="module")
def router(upstream):
    proc = ServerProcess(["--prefill", upstream.url, "--decode", upstream.url], command="router")
    yield proc
    proc.stop()


def test_the_clients_request_id_reaches_the_prefill_and_decode_servers(router, upstream):
    upstream.seen.clear()
    r = httpx.post(router.base_url + "/chat/completions", headers={"X-Request-Id": "trace-42"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert upstream.seen == [("POST", "/v1/chat/completions", "trace-42")] * 2  # prefill, decode


def test_without_a_client_id_the_servers_get_the_routers_own(router, upstream):
    upstream.seen.clear()
    r = httpx.post(router.base_url + "/completions", json={"prompt": "hi", "max_tokens": 4})
    given = r.headers["x-request-id"]
    assert r.status_code == 200 and len(given) == 32
    assert [seen[2] for seen in upstream.seen] == [given, given]
    # An id unfit to echo (not visible ASCII) is replaced before it goes anywhere.
    upstream.seen.clear()
    r = httpx.post(router.base_url + "/completions", headers={"X-Request-Id": "a b"},
                   json={"prompt": "hi", "max_tokens": 4})
    assert r.headers["x-request-id"] != "a b"
    assert {seen[2] for seen in upstream.seen} == {r.headers["x-request-id"]}


@pytest.mark.parametrize("method,path", [
    ("POST", "/tokenize"), ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
    ("DELETE", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel"),
    ("GET", "/v1/responses/resp_1/input_items"), ("GET", "/v1/models"), ("POST", "/score"),
    ("POST", "/v1/score"), ("POST", "/rerank"), ("POST", "/v1/rerank"), ("POST", "/v2/rerank")])
def test_every_passed_on_route_carries_the_id(router, upstream, method, path):
    upstream.seen.clear()
    body = {"prompt": "hi"} if method == "POST" else None
    r = httpx.request(method, router.url + path, json=body, headers={"X-Request-Id": "t-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "t-1"
    assert upstream.seen == [(method, path, "t-1")]


def test_reset_prefix_cache_goes_to_every_server(router, upstream):
    for method in ("GET", "POST"):  # (and /ping is the router's /health, as on the servers)
        assert httpx.request(method, router.url + "/ping").json()["status"] == "healthy"
    upstream.seen.clear()
    r = httpx.post(router.url + "/reset_prefix_cache", headers={"X-Request-Id": "t-2"})
    assert r.status_code == 200 and list(r.json()["servers"]) == [upstream.url]  # once each
    assert upstream.seen == [("POST", "/reset_prefix_cache", "t-2")]
    upstream.seen.clear()
    upstream.bodies.clear()
    r = httpx.post(router.url + "/update_weights_from_disk", json={"model_path": "/ckpt/7"})
    assert r.status_code == 200 and list(r.json()["servers"]) == [upstream.url]
    assert [seen[:2] for seen in upstream.seen] == [("POST", "/update_weights_from_disk")]
    assert upstream.bodies == [{"model_path": "/ckpt/7"}]  # the client's body, passed on
    upstream.seen.clear()
    for path in ("/start_profile", "/stop_profile"):  # each server traces its own steps
        r = httpx.post(router.url + path)
        assert r.status_code == 200 and list(r.json()["servers"]) == [upstream.url]
    assert [seen[:2] for seen in upstream.seen] == [("POST", "/start_profile"),
                                                    ("POST", "/stop_profile")]
    down = f"http://127.0.0.1:{free_port()}"
    proc = ServerProcess(["--prefill", down, "--decode", upstream.url], command="router")
    try:
        r = httpx.post(proc.url + "/reset_prefix_cache")
        assert r.status_code == 502 and r.json()["servers"][down] is None
        assert isinstance(r.json()["servers"][upstream.url], dict)
        r = httpx.get(proc.url + "/is_sleeping")  # a server that cannot say: no answer
        assert r.status_code == 502 and r.json()["servers"][down] is None
    finally:
        proc.stop()


def test_invocations_go_where_their_api_would(router, upstream):
    """SageMaker's route: a chat body through a prefill and a decode server as on its own path;
    embeddings, score and rerank bodies straight to a decode server."""
    for body, want in (({"messages": [{"role": "user", "content": "hi"}]},
                        [("POST", "/v1/chat/completions", "t-3")] * 2),
                       ({"prompt": "hi"}, [("POST", "/v1/completions", "t-3")] * 2),
                       # embeddings' KV cannot move: straight to a decode server
                       ({"prompt_embeds": "..."}, [("POST", "/v1/completions", "t-3")]),
                       ({"prompt": "hi", "prompt_logprobs": 1},
                        [("POST", "/v1/completions", "t-3")]),
                       ({"input": "hi"}, [("POST", "/invocations", "t-3")]),
                       ({"text_1": "a", "text_2": "b"}, [("POST", "/invocations", "t-3")]),
                       # ambiguous: the decode server's /invocations refuses it, not a prefill
                       ({"prompt": "hi", "documents": ["a"]}, [("POST", "/invocations", "t-3")])):
        upstream.seen.clear()
        r = httpx.post(router.url + "/invocations", json=body, headers={"X-Request-Id": "t-3"})
        assert r.status_code == 200 and upstream.seen == want, body
