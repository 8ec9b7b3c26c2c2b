"""Prefill/decode disaggregation over HTTP: a real prefill server, a real decode server (another
block size) and `ksana-llm router` in front (tests/kv_transfer_servers.py), driven by the
official `openai` client. Answers must equal the Python API's on the same model (whose greedy
tokens equal transformers', tests/test_kv_transfer.py); the decode server must really decode
from the prefill server's KV (its counters say so), and every failure of the transfer must
still give the right answer, or a clear error. The router's behaviour when a server fails,
freezes or refuses: tests/test_router_failures.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import time

import httpx
import openai
import pytest
import torch

import ksana_llm as kt
from ksana_llm.runner.kv_transfer import TransferredKv
from tests.kv_transfer_servers import (PROMPT, QUESTION, chat_prompt_ids, client, decode,
                                       metric_total, openai_error, prefill, router)
from tests.server_process import ServerProcess, free_port, stub_http_server
from tests.tolerances import LOGIT_ATOL

__all__ = ["client", "decode", "prefill", "router"]  # module fixtures, used by name


def test_chat_through_router_decodes_from_prefill_kv(client, prefill, decode, router, local_engine):
    ids = chat_prompt_ids(local_engine, QUESTION)
    want = local_engine.generate(ids, kt.GenerationConfig(max_new_tokens=24, temperature=0))
    imported, exported = (metric_total(decode, "kv_transfer_imported_tokens"),
                          metric_total(prefill, "kv_transfer_exported_tokens"))
    answer = client.chat.completions.create(model=None, messages=QUESTION, temperature=0,
                                            max_tokens=24)
    assert answer.choices[0].message.content == want
    assert answer.usage.prompt_tokens == len(ids)
    # The prefill server computed the prompt; the decode server only its last token.
    assert metric_total(prefill, "kv_transfer_exported_tokens") - exported == len(ids)
    assert metric_total(decode, "kv_transfer_imported_tokens") - imported == len(ids) - 1
    # ... and reports the imported tokens as cached, as vLLM counts a KV connector's tokens.
    assert answer.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
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
    assert openai_error(httpx.get(f"{prefill.url}/kv_transfer/{params['transfer_id']}"), 404)["code"] \
        == "kv_transfer_not_found"
    openai_error(httpx.get(f"{prefill.url}/kv_transfer/nonsense"), 404)


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
        error = openai_error(post(server, params, **extra), 400)
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
    imported = metric_total(decode, "kv_transfer_imported_tokens")
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
    assert metric_total(decode, "kv_transfer_imported_tokens") == imported
    after = httpx.get(decode.base_url + "/stats").json()["kv_transfer"]
    assert after["num_fetch_failures"] - stats["num_fetch_failures"] == len(sources)
    assert after["num_fetched"] == stats["num_fetched"]


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
        # A background stream resumed through the router (OpenAI's `starting_after`) is
        # relayed as the event stream it is.
        events = list(routed.responses.create(model="SmolLM2-135M-Instruct", input="Hi.",
                                              max_output_tokens=4, background=True, stream=True))
        resumed = httpx.get(f"{proc.base_url}/responses/{events[-1].response.id}",
                            params={"stream": "true", "starting_after": 2}, timeout=60)
        assert resumed.headers["content-type"].startswith("text/event-stream")
        numbers = [json.loads(line[6:])["sequence_number"] for line in resumed.text.splitlines()
                   if line.startswith("data: {")]
        assert numbers == [e.sequence_number for e in events][3:]
        # A conversation the router never saw (made on a server directly) is continued on the
        # server that holds it, every time, not on whichever comes next.
        direct = openai.OpenAI(base_url=prefill.base_url, api_key="unused", max_retries=0,
                               timeout=60).responses.create(
            model="SmolLM2-135M-Instruct", input="Hi.", max_output_tokens=2)
        for _ in range(2):
            assert routed.responses.create(model="SmolLM2-135M-Instruct", input="And?",
                                           max_output_tokens=2,
                                           previous_response_id=direct.id).id
    finally:
        proc.stop()


def test_responses_pass_over_a_decode_server_that_is_down(decode):
    """New conversations go to the next decode server when one refuses the connection (as chat
    does), and an id the router does not know is looked for on the servers that answer."""
    down = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    proc = ServerProcess(["--decode", down, "--decode", decode.url], command="router")
    try:
        routed = openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0,
                               timeout=60)
        answers = [routed.responses.create(model="SmolLM2-135M-Instruct", input="Hi.",
                                           max_output_tokens=2) for _ in range(3)]
        assert all(a.status in ("completed", "incomplete") for a in answers)
        with pytest.raises(openai.NotFoundError):  # 404, not the dead server's 503
            routed.responses.retrieve("resp_unknown")
    finally:
        proc.stop()
