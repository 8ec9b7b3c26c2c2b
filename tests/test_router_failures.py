"""`ksana-llm router` when a server fails, freezes or refuses (real prefill and decode servers,
tests/kv_transfer_servers.py, and stub servers that never answer): no request is lost or left
waiting on a frozen server, errors are the client's own in the client's numbers, KV a refused
request leaves on the prefill server is dropped, and tenants' `cache_salt` holds there too."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import httpx
import pytest

import ksana_llm as kt
from tests.kv_transfer_servers import (PROMPT, QUESTION, chat_prompt_ids, decode, metric_total,
                                       openai_error, prefill, router)
from tests.server_process import ServerProcess, free_port, stub_http_server

__all__ = ["decode", "prefill", "router"]  # module fixtures, used by name


@pytest.mark.parametrize("prefill_server", ["down", "not a prefill server"])
def test_router_without_a_working_prefill_server(decode, local_engine, prefill_server):
    """A prefill server that is down, or refuses the KV-transfer part (here: a decode server,
    which answers do_remote_decode with a 400 about kv_transfer_params): the decode server
    computes the prompt."""
    url = f"http://127.0.0.1:{free_port()}" if prefill_server == "down" else decode.url
    proc = ServerProcess(["--prefill", url, "--decode", decode.url], command="router")
    try:
        r = httpx.post(proc.base_url + "/chat/completions", timeout=60, json={
            "messages": QUESTION, "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200
        want = local_engine.generate(chat_prompt_ids(local_engine, QUESTION),
                                     kt.GenerationConfig(max_new_tokens=16, temperature=0))
        assert r.json()["choices"][0]["message"]["content"] == want
        health = httpx.get(proc.url + "/health")
        assert health.status_code == 200  # it still answers
        assert health.json()["num_prefill_failures"] == 1 and health.json()["num_direct"] == 1
        assert health.json()["status"] == ("degraded" if prefill_server == "down" else "healthy")
    finally:
        proc.stop()


def test_router_passes_client_errors_through(router):
    r = httpx.post(router.base_url + "/chat/completions", timeout=60, json={
        "messages": [{"role": "robot", "content": "hi"}]})
    assert openai_error(r, 400)["param"]
    # The same body as a server's own (code invalid_json), so clients need not tell them apart.
    assert openai_error(httpx.post(router.base_url + "/completions", content=b"{not json"),
                        400)["code"] == "invalid_json"
    openai_error(httpx.post(router.base_url + "/completions", json=[1, 2]), 400)
    # The router's answers carry a request id (the client's when it sent one), passed-on
    # errors too.
    traced = httpx.post(router.base_url + "/completions", json=[1, 2],
                        headers={"X-Request-Id": "trace-7"})
    assert traced.headers["x-request-id"] == "trace-7"


def test_a_prompt_with_no_room_for_the_completion_is_refused_before_its_prefill(
        router, prefill):
    """The router gives the prefill server the client's max_tokens as `decode_max_tokens`: a
    prompt that fits alone but not with the completion is the client's 400, in the client's
    numbers, and is never computed (nor its KV kept for a fetch that would never come)."""
    limit = httpx.get(prefill.base_url + "/models").json()["data"][0]["max_model_len"]
    prompt = [1000 + i % 500 for i in range(limit - 20)]
    exported = metric_total(prefill, "kv_transfer_exported_tokens")
    before = httpx.get(router.url + "/health").json()
    r = httpx.post(router.base_url + "/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 100})
    error = openai_error(r, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"({len(prompt)} in the prompt, 100 in the completion)" in error["message"]
    # Longer than the whole context: still the client's numbers (the prefill server refuses
    # the router's one-token request; the decode server refuses the client's own).
    too_long = [1000 + i % 500 for i in range(limit + 5)]
    r = httpx.post(router.base_url + "/completions", timeout=60,
                   json={"prompt": too_long, "max_tokens": 7})
    assert f"({len(too_long)} in the prompt, 7 in the completion)" in \
        openai_error(r, 400)["message"]
    after = httpx.get(router.url + "/health").json()
    assert after["num_disaggregated"] == before["num_disaggregated"]
    assert after["num_prefill_failures"] == before["num_prefill_failures"]
    assert metric_total(prefill, "kv_transfer_exported_tokens") == exported
    # Asked of the prefill server directly: the same refusal, and a bad budget is a 400 too;
    # without one (vLLM's proxies send none) the prompt alone is checked, as before.
    body = {"prompt": prompt, "max_tokens": 1}
    refused = httpx.post(prefill.base_url + "/completions", timeout=60, json={
        **body, "kv_transfer_params": {"do_remote_decode": True, "decode_max_tokens": 100}})
    assert openai_error(refused, 400)["code"] == "context_length_exceeded"
    bad = httpx.post(prefill.base_url + "/completions", timeout=60, json={
        **body, "kv_transfer_params": {"do_remote_decode": True, "decode_max_tokens": 0}})
    assert openai_error(bad, 400)["param"] == "kv_transfer_params"
    kept = httpx.post(prefill.base_url + "/completions", timeout=60, json={
        **body, "kv_transfer_params": {"do_remote_decode": True}})
    assert kept.status_code == 200 and kept.json()["kv_transfer_params"]["transfer_id"]


def test_a_model_the_prefill_server_lacks_goes_to_a_decode_server_uncounted(router):
    """An unknown `model` may be a decode server's adapter: no prefill failure is counted, and
    the decode server's 404 is the answer."""
    before = httpx.get(router.url + "/health").json()
    r = httpx.post(router.base_url + "/completions", timeout=60,
                   json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert openai_error(r, 404)["param"] == "model"
    after = httpx.get(router.url + "/health").json()
    assert after["num_prefill_failures"] == before["num_prefill_failures"]
    assert after["num_direct"] == before["num_direct"] + 1


def test_a_decode_server_that_is_down_loses_no_requests(decode, local_engine):
    """A decode server refusing connections never got the request: the next one answers it
    (streamed or not), and the model list comes from the first one up."""
    down = f"http://127.0.0.1:{free_port()}"
    proc = ServerProcess(["--decode", down, "--decode", decode.url], command="router")
    try:
        want = local_engine.generate(PROMPT, kt.GenerationConfig(max_new_tokens=4))
        for stream in (False, True, False, True):
            r = httpx.post(proc.base_url + "/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                text = "".join(json.loads(line[6:])["choices"][0]["text"]
                               for line in r.text.splitlines()
                               if line.startswith("data: {"))
            else:
                text = r.json()["choices"][0]["text"]
            assert text == want
        for path in ("/v1/models", "/models"):
            models = httpx.get(proc.url + path, timeout=30)
            assert models.status_code == 200 and models.json()["data"], path
        assert httpx.get(proc.url + "/version").json()["version"] == kt.__version__
    finally:
        proc.stop()


def test_decode_server_dying_mid_stream_ends_routed_streams_with_an_error():
    """A decode server killed while it streams: the router ends each client's stream as the
    servers end theirs on an engine failure (an SSE error event then `data: [DONE]`; a NUL
    terminated error chunk on /generate), rather than a cut-off response."""
    decode = ServerProcess(["--num-device-blocks", "256"])
    router = None
    try:
        router = ServerProcess(["--decode", decode.url], command="router")
        sse, native = asyncio.run(_streams_cut_by_a_kill(router.url, decode))
    finally:
        if router is not None:
            router.stop()
        decode.stop()
    events = sse.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "service_unavailable" and "mid-stream" in error["message"]
    for event in events[:-3]:  # the events passed on before it are whole
        assert json.loads(event.removeprefix("data: "))["choices"]
    chunks = native.split(b"\0")
    assert chunks[-1] == b"" and json.loads(chunks[-2])["error"]["type"] == "service_unavailable"
    for chunk in chunks[:-2]:
        assert "texts" in json.loads(chunk)


async def _streams_cut_by_a_kill(url: str, decode: ServerProcess) -> tuple[bytes, bytes]:
    """A completions stream and a /generate stream through the router, the decode server
    killed once both are under way; what each client received."""
    started = [asyncio.Event(), asyncio.Event()]

    async def stream(path: str, body: dict, started: asyncio.Event) -> bytes:
        received = b""
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", url + path, json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for chunk in r.aiter_bytes():
                    received += chunk
                    started.set()
        return received

    async def kill() -> None:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        await asyncio.sleep(0.3)
        decode.proc.kill()

    long = {"max_tokens": 1000, "ignore_eos": True, "stream": True}
    sse, native, _ = await asyncio.gather(
        stream("/v1/completions", {"prompt": PROMPT, **long}, started[0]),
        stream("/generate", {"prompt": PROMPT, "stream": True, "sampling_config": {
            "max_new_tokens": 1000, "ignore_eos": True}}, started[1]),
        kill())
    return sse, native


class _Freezing(http.server.BaseHTTPRequestHandler):
    """A server that answers /health until `frozen` is set, then takes connections and never
    answers in time (a process stopped or stuck after the router started)."""

    frozen = threading.Event()

    def do_GET(self) -> None:
        if self.frozen.is_set():
            time.sleep(20)
            return
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        time.sleep(20)

    def log_message(self, *args) -> None:
        pass


def test_a_frozen_prefill_server_is_passed_over(decode, local_engine):
    """The prefill call has its own time limit (--prefill-timeout): then the decode server
    computes the prompt, and the frozen server rests, so the next request does not wait for it
    again. The router's probes (/load, /v1/stats, /is_sleeping) answer without it, 502."""
    want = local_engine.generate(PROMPT, kt.GenerationConfig(max_new_tokens=4))
    _Freezing.frozen.clear()
    with stub_http_server(_Freezing) as frozen:
        proc = ServerProcess(["--prefill", frozen, "--decode", decode.url,
                              "--prefill-timeout", "2"], command="router")
        _Freezing.frozen.set()
        try:
            for _ in range(2):
                r = httpx.post(proc.base_url + "/completions", timeout=60, json={
                    "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
            health = httpx.get(proc.url + "/health", timeout=30).json()
            assert (health["num_prefill_failures"], health["num_direct"]) == (1, 2)
            for path, key in (("/load", "server_load"), ("/v1/stats", None),
                              ("/is_sleeping", "is_sleeping")):
                probe = httpx.get(proc.url + path, timeout=30)  # waits 10 s for the frozen one
                assert probe.status_code == 502, path
                servers = probe.json()["servers"]
                assert servers[frozen] is None and servers[decode.url] is not None, path
        finally:
            proc.stop()


class _Overloaded(http.server.BaseHTTPRequestHandler):
    """A decode server that is up (/health) but takes no request (503, OpenAI's error body)."""

    def do_GET(self) -> None:
        self._answer(200, b"{}")

    def do_POST(self) -> None:
        self._answer(503, json.dumps({"error": {
            "message": "overloaded", "type": "service_unavailable", "param": None,
            "code": None}}).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _kept(prefill) -> int:
    return httpx.get(prefill.base_url + "/stats").json()["kv_transfer"]["num_kept"]


def _until_kept(prefill, count: int) -> None:
    deadline = time.monotonic() + 15
    while _kept(prefill) != count:
        assert time.monotonic() < deadline, f"{_kept(prefill)} KV entries kept, not {count}"
        time.sleep(0.1)


def test_kv_of_a_request_the_decode_side_refuses_is_dropped(router, prefill):
    """The prefill server sees only the prompt's fields, so a request the decode server then
    refuses (or cannot take) was computed there: the router drops its KV at
    once, instead of leaving it in host memory (and pushing out others') until the TTL."""
    kept = _kept(prefill)
    before = httpx.get(router.url + "/health").json()
    for bad in ({"logprobs": 1000}, {"stop_token_ids": [999_999_999]}):
        r = httpx.post(router.base_url + "/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 5, **bad})
        assert openai_error(r, 400)["param"]
    after = httpx.get(router.url + "/health").json()
    assert after["num_disaggregated"] == before["num_disaggregated"] + 2  # computed, then refused
    _until_kept(prefill, kept)
    with stub_http_server(_Overloaded) as overloaded:
        proc = ServerProcess(["--prefill", prefill.url, "--decode", overloaded],
                             command="router")
        try:
            r = httpx.post(proc.base_url + "/completions", timeout=60,
                           json={"prompt": PROMPT, "max_tokens": 5})
            assert openai_error(r, 503)["type"] == "service_unavailable"
            _until_kept(prefill, kept)
        finally:
            proc.stop()
    # The route the router uses: unknown (or already dropped) ids are a 404.
    missing = httpx.delete(prefill.url + "/kv_transfer/" + "0" * 32)
    assert openai_error(missing, 404)["code"] == "kv_transfer_not_found"


def test_cache_salt_keeps_tenants_apart_on_the_prefill_server(router, prefill):
    """vLLM's cache_salt: a prompt cached for one salt is no prefix-cache hit for another --
    on the prefill server too, where the router has the prompt computed."""
    prompt = "Salted: " + PROMPT * 6

    def hits() -> int:
        return httpx.get(prefill.base_url + "/stats").json()["num_prefix_cache_hits"]

    def ask(salt: str) -> None:
        r = httpx.post(router.base_url + "/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 2, "cache_salt": salt})
        assert r.status_code == 200, r.text

    ask("tenant-a")
    start = hits()
    ask("tenant-b")
    assert hits() == start  # B does not read A's blocks
    ask("tenant-a")
    assert hits() > start  # A's own prompt does hit
