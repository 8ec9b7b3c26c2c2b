"""Prefill/decode disaggregation over HTTP: a real prefill server (vLLM's `serve
--kv-transfer-config '{"kv_role": "kv_producer", ...}'`, i.e. `--kv-role prefill`), a
real decode server (`serve --kv-role decode`, another block size) and `ksana-llm router` in front,
driven by the official `openai` client. Answers must equal the Python API's on the same model
(whose greedy tokens equal transformers', tests/test_kv_transfer.py); the decode server must
really decode from the prefill server's KV (its counters say so), and every failure of the
transfer must still give the right answer, or a clear error."""

from __future__ import annotations

import asyncio
import http.server
import json
import re
import time

import httpx
import openai
import pytest
import torch

import ksana_llm as kt
from ksana_llm.runner.kv_transfer import TransferredKv
from tests.server_process import ServerProcess, free_port, stub_http_server
from tests.tolerances import LOGIT_ATOL

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


@pytest.fixture(scope="module")
def prefill(default_model_dir):
    # vLLM's spelling of --kv-role prefill (the decode server below uses ours).
    proc = ServerProcess(["--kv-transfer-config",
                          '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}',
                          "--num-device-blocks", "128"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def decode(default_model_dir):
    proc = ServerProcess(["--kv-role", "decode", "--num-device-blocks", "192",
                          "--block-token-num", "8"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def router(prefill, decode):
    proc = ServerProcess(["--prefill", prefill.url, "--decode", decode.url], command="router")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=60)


def _counter(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^ksana_llm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["message"]
    return body["error"]


def _chat_ids(local_engine: kt.Engine, messages: list[dict]) -> list[int]:
    tok = local_engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_chat_through_router_decodes_from_prefill_kv(client, prefill, decode, router, local_engine):
    ids = _chat_ids(local_engine, QUESTION)
    want = local_engine.generate(ids, kt.GenerationConfig(max_new_tokens=24, temperature=0))
    imported, exported = (_counter(decode, "kv_transfer_imported_tokens"),
                          _counter(prefill, "kv_transfer_exported_tokens"))
    answer = client.chat.completions.create(model=None, messages=QUESTION, temperature=0,
                                            max_tokens=24)
    assert answer.choices[0].message.content == want
    assert answer.usage.prompt_tokens == len(ids)
    # The prefill server computed the prompt; the decode server only its last token.
    assert _counter(prefill, "kv_transfer_exported_tokens") - exported == len(ids)
    assert _counter(decode, "kv_transfer_imported_tokens") - imported == len(ids) - 1
    stream = client.chat.completions.create(model=None, messages=QUESTION, temperature=0,
                                            max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    health = httpx.get(router.url + "/health").json()
    assert health["status"] == "healthy" and health["num_disaggregated"] >= 2
    assert set(health["servers"].values()) == {200}
    assert [m.id for m in client.models.list().data] == [
        m["id"] for m in httpx.get(decode.base_url + "/models").json()["data"]]
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_completion_through_router_with_logprobs(client, local_engine):
    config = kt.GenerationConfig(max_new_tokens=12, temperature=0, logprobs=2)
    want = local_engine.generate_outputs(PROMPT, config)[0]
    got = client.completions.create(model=None, prompt=PROMPT, max_tokens=12, temperature=0,
                                    logprobs=2)
    choice = got.choices[0]
    assert choice.text == want.text
    assert choice.logprobs.token_logprobs == pytest.approx(
        [e["logprob"] for e in want.logprobs], abs=LOGIT_ATOL)
    # Several prompts in one request: the decode server computes them (no split).
    two = client.completions.create(model=None, prompt=[PROMPT, "The capital of France is"],
                                    max_tokens=6, temperature=0)
    assert two.choices[0].text == local_engine.generate(
        PROMPT, kt.GenerationConfig(max_new_tokens=6, temperature=0))


def test_kept_kv_is_fetched_once(prefill, local_engine):
    r = httpx.post(prefill.base_url + "/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200
    params = r.json()["kv_transfer_params"]
    ids = local_engine.tokenizer.encode(PROMPT)
    assert params["do_remote_prefill"] is True and params["num_tokens"] == len(ids)
    fetched = httpx.get(f"{prefill.url}/kv_transfer/{params['transfer_id']}")
    assert fetched.status_code == 200
    kv = TransferredKv.from_bytes(fetched.content)
    assert list(kv.token_ids) == ids
    assert _error(httpx.get(f"{prefill.url}/kv_transfer/{params['transfer_id']}"), 404)["code"] \
        == "kv_transfer_not_found"
    _error(httpx.get(f"{prefill.url}/kv_transfer/nonsense"), 404)


def test_bad_kv_transfer_params_are_400(prefill, decode):
    def post(server: ServerProcess, params, **extra) -> httpx.Response:
        return httpx.post(server.base_url + "/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params, **extra})

    cases = [
        (prefill, {"do_remote_decode": True}, {"stream": True}, "streaming"),
        (prefill, {"do_remote_decode": True}, {"n": 2, "temperature": 1.0}, "n=1"),
        (prefill, {"do_remote_prefill": True, "remote_url": "http://x", "transfer_id": "y"}, {},
         "--kv-role is prefill"),
        (decode, {"do_remote_decode": True}, {}, "--kv-role is decode"),
        (decode, {"do_remote_prefill": True}, {}, "remote_url and transfer_id"),
        (decode, {"do_remote_prefill": True, "remote_url": "file:///etc/passwd",
                  "transfer_id": "y"}, {}, "http"),
        (decode, {"do_remote_prefill": True, "remote_url": "http://[::1/x", "transfer_id": "y"},
         {}, "http"),
        (prefill, {"do_remote_decode": True}, {"best_of": 2, "temperature": 1.0}, "best_of"),
        (decode, {"do_remote_decode": "yes"}, {}, "Invalid kv_transfer_params"),
        (decode, {"do_remote_prefill": True, "remote_port": 1}, {}, "Invalid kv_transfer_params"),
    ]
    for server, params, extra, words in cases:
        error = _error(post(server, params, **extra), 400)
        assert error["param"] == "kv_transfer_params" and words in error["message"], error
    # Both still serve.
    assert post(prefill, None).status_code == 200 and post(decode, None).status_code == 200


def _payload_handler(payloads: dict[str, bytes]) -> type[http.server.BaseHTTPRequestHandler]:
    """Answers every GET with fixed bytes: KV payloads a prefill server of this deployment
    would never send."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = payloads[self.path.rsplit("/", 1)[-1]]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    return Handler


def test_failed_fetch_falls_back_to_a_local_prefill(decode, prefill, local_engine):
    """KV that cannot be had or used costs time, never the answer: a server that is down, a
    transfer id nobody keeps, and payloads that are garbage, from another model (fewer KV
    heads, or the same shapes with other weights), or larger than a whole context's KV."""
    ids = local_engine.tokenizer.encode(PROMPT)
    r = httpx.post(prefill.base_url + "/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    kv = TransferredKv.from_bytes(httpx.get(
        f"{prefill.url}/kv_transfer/{r.json()['kv_transfer_params']['transfer_id']}").content)
    other_model = TransferredKv(kv.token_ids, tuple(t[:, :1] for t in kv.tensors)).to_bytes()
    # The same shapes from a model with other weights (a fine-tune): told by the fingerprint.
    other_weights = TransferredKv(kv.token_ids, kv.tensors, kv.kv_scales, "f" * 32).to_bytes()
    # The decode server holds 1,536 tokens: KV for 2,048 is more than any context's (and would
    # be used, its first rows being the prompt's, but for the size limit).
    pad = 2048 - len(ids)
    huge = TransferredKv(kv.token_ids + (0,) * pad, tuple(
        torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) for t in kv.tensors)).to_bytes()
    handler = _payload_handler({"garbage": b"\x00" * 64, "other-model": other_model,
                                "other-weights": other_weights, "huge": huge})
    stats = httpx.get(decode.base_url + "/stats").json()["kv_transfer"]
    imported = _counter(decode, "kv_transfer_imported_tokens")
    want = local_engine.generate(PROMPT, kt.GenerationConfig(max_new_tokens=8, temperature=0))
    with stub_http_server(handler) as payload_url:
        sources = [(f"http://127.0.0.1:{free_port()}", "0" * 32), (decode.url, "0" * 32),
                   *((payload_url, name)
                     for name in ("garbage", "other-model", "other-weights", "huge"))]
        for remote, transfer_id in sources:
            r = httpx.post(decode.base_url + "/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "kv_transfer_params": {
                    "do_remote_prefill": True, "remote_url": remote, "transfer_id": transfer_id}})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, remote
    assert _counter(decode, "kv_transfer_imported_tokens") == imported
    after = httpx.get(decode.base_url + "/stats").json()["kv_transfer"]
    assert after["num_fetch_failures"] - stats["num_fetch_failures"] == len(sources)
    assert after["num_fetched"] == stats["num_fetched"]


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
        want = local_engine.generate(_chat_ids(local_engine, QUESTION),
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
    assert _error(r, 400)["param"]
    _error(httpx.post(router.base_url + "/completions", content=b"{not json"), 400)
    _error(httpx.post(router.base_url + "/completions", json=[1, 2]), 400)
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
    exported = _counter(prefill, "kv_transfer_exported_tokens")
    before = httpx.get(router.url + "/health").json()
    r = httpx.post(router.base_url + "/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 100})
    error = _error(r, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"({len(prompt)} in the prompt, 100 in the completion)" in error["message"]
    after = httpx.get(router.url + "/health").json()
    assert after["num_disaggregated"] == before["num_disaggregated"]
    assert after["num_prefill_failures"] == before["num_prefill_failures"]
    assert _counter(prefill, "kv_transfer_exported_tokens") == exported
    # Asked of the prefill server directly: the same refusal, and a bad budget is a 400 too;
    # without one (vLLM's proxies send none) the prompt alone is checked, as before.
    body = {"prompt": prompt, "max_tokens": 1}
    refused = httpx.post(prefill.base_url + "/completions", timeout=60, json={
        **body, "kv_transfer_params": {"do_remote_decode": True, "decode_max_tokens": 100}})
    assert _error(refused, 400)["code"] == "context_length_exceeded"
    bad = httpx.post(prefill.base_url + "/completions", timeout=60, json={
        **body, "kv_transfer_params": {"do_remote_decode": True, "decode_max_tokens": 0}})
    assert _error(bad, 400)["param"] == "kv_transfer_params"
    kept = httpx.post(prefill.base_url + "/completions", timeout=60, json={
        **body, "kv_transfer_params": {"do_remote_decode": True}})
    assert kept.status_code == 200 and kept.json()["kv_transfer_params"]["transfer_id"]


def test_a_model_the_prefill_server_lacks_goes_to_a_decode_server_uncounted(router):
    """An unknown `model` may be a decode server's adapter: no prefill failure is counted, and
    the decode server's 404 is the answer."""
    before = httpx.get(router.url + "/health").json()
    r = httpx.post(router.base_url + "/completions", timeout=60,
                   json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert _error(r, 404)["param"] == "model"
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


def test_router_resets_every_servers_prefix_cache(router, prefill, decode):
    body = {"prompt": "Cached: " + PROMPT * 3, "max_tokens": 1}

    def cached() -> int:
        usage = httpx.post(decode.base_url + "/completions", json=body, timeout=60).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    r = httpx.post(router.url + "/reset_prefix_cache")
    assert r.status_code == 200 and set(r.json()["servers"]) == {prefill.url, decode.url}
    assert r.json()["servers"][decode.url]["num_blocks_dropped"] > 0
    assert cached() == 0


def test_router_answers_browser_preflights(router):
    """CORS as on the servers (any origin by default, as vLLM)."""
    r = httpx.options(router.base_url + "/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_client_leaving_a_routed_stream_aborts_it_on_the_decode_server(router, decode):
    body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def leave_early() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", router.base_url + "/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return  # closes the connection mid-stream

    async def give_up() -> None:  # a non-streaming client that stops waiting
        async with httpx.AsyncClient(timeout=1.0) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(router.base_url + "/completions", json={**body, "stream": False})

    asyncio.run(leave_early())
    asyncio.run(give_up())
    deadline = time.monotonic() + 15
    while httpx.get(decode.url + "/health").json()["num_running"]:
        assert time.monotonic() < deadline, "the decode server still runs the request"
        time.sleep(0.1)


def test_native_and_tokenizer_routes_go_straight_to_a_decode_server(router, decode):
    body = {"prompt": PROMPT, "sampling_config": {"max_new_tokens": 8}, "stream": False}
    direct = httpx.post(decode.url + "/generate", json=body, timeout=60)
    routed = httpx.post(router.url + "/generate", json=body, timeout=60)
    assert routed.status_code == 200 and routed.json() == direct.json()
    streamed = httpx.post(router.url + "/generate", json={**body, "stream": True}, timeout=60)
    chunks = [c for c in streamed.content.split(b"\0") if c]
    assert streamed.status_code == 200 and len(chunks) > 1
    assert json.loads(chunks[-1])["texts"] == direct.json()["texts"]
    tokens = httpx.post(router.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tokens == httpx.post(decode.url + "/tokenize", json={"prompt": PROMPT}).json()
    embedded = httpx.post(router.url + "/v1/embeddings", json={"input": PROMPT}, timeout=60)
    assert embedded.status_code == 200
    assert embedded.json()["data"] == httpx.post(decode.url + "/v1/embeddings",
                                                 json={"input": PROMPT}, timeout=60).json()["data"]
    bad = httpx.post(router.url + "/generate", json={"sampling_config": {}}, timeout=60)
    assert bad.status_code == 400 == httpx.post(decode.url + "/generate",
                                                json={"sampling_config": {}}).status_code


def test_responses_continue_on_the_decode_server_that_stored_them(prefill, decode, local_engine):
    """Two decode servers, taken in turn: a continuation (`previous_response_id`), a stored
    response's GET and DELETE, and a streamed response's continuation all reach the server
    that holds the conversation (the other one answers 404 for it)."""
    proc = ServerProcess(["--decode", decode.url, "--decode", prefill.url], command="router")
    try:
        routed = openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0,
                               timeout=60)
        first = routed.responses.create(model="SmolLM2-135M-Instruct", input=QUESTION[0]["content"],
                                        temperature=0, max_output_tokens=16)
        chain = [first]
        for _ in range(3):  # round robin would send every other one elsewhere
            chain.append(routed.responses.create(
                model="SmolLM2-135M-Instruct", input="Say it again.", temperature=0,
                max_output_tokens=8, previous_response_id=chain[-1].id))
        assert all(r.status in ("completed", "incomplete") for r in chain)
        homes = [server for server in (decode, prefill)
                 if httpx.get(f"{server.base_url}/responses/{first.id}").status_code == 200]
        assert len(homes) == 1  # stored on one server only
        assert routed.responses.retrieve(chain[-1].id).id == chain[-1].id
        background = routed.responses.create(model="SmolLM2-135M-Instruct", input="Hi.",
                                             max_output_tokens=4, background=True)
        for _ in range(600):
            polled = routed.responses.retrieve(background.id)
            if polled.status != "in_progress":
                break
            time.sleep(0.1)
        assert polled.status in ("completed", "incomplete") and polled.output_text
        # Relayed to the server that holds it: cancelling a finished one returns it (OpenAI's).
        relayed = routed.responses.cancel(background.id)
        assert (relayed.id, relayed.status) == (background.id, polled.status)
        items = routed.responses.input_items.list(chain[-1].id, order="asc", limit=100).data
        assert len(items) == 2 * len(chain) - 1  # each turn's input and output, then its own
        assert items[0].content[0].text == QUESTION[0]["content"]
        streamed = list(routed.responses.create(
            model="SmolLM2-135M-Instruct", input="Once more.", temperature=0, max_output_tokens=4,
            previous_response_id=chain[-1].id, stream=True))
        after = routed.responses.create(model="SmolLM2-135M-Instruct", input="Thanks.",
                                        max_output_tokens=2,
                                        previous_response_id=streamed[-1].response.id)
        assert after.previous_response_id == streamed[-1].response.id
        routed.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            routed.responses.retrieve(first.id)
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
