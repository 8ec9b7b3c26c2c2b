"""The OpenAI-compatible server's errors, as a real subprocess driven by `httpx` and the
official `openai` client: one test per 400 class with its exact param and code, 404, 413, 401
(API key), 429 with Retry-After for a full queue; and, with the app in-process, 503 once the
engine is dead or a request waited too long."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

import ksana_llm as kt
from tests.server_process import ServerProcess, server_fixture, openai_error

KV_ARGS = ["--num-device-blocks", "256"]
MAX_BODY = 64 * 1024
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


server = server_fixture([*KV_ARGS, "--max-body-bytes", str(MAX_BODY)])


# ---- errors ------------------------------------------------------------------------------------

BAD_REQUESTS = [
    # (id, route, body (dict, or raw bytes), param, code)
    ("malformed_json", "/v1/completions", b'{"prompt": "x",', None, "invalid_json"),
    ("not_an_object", "/v1/completions", b"[1, 2]", None, None),
    ("wrong_type", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens", None),
    ("wrong_type_bool", "/v1/chat/completions", {"messages": QUESTION, "stream": "yes"}, "stream", None),
    ("out_of_range_temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", None),
    ("infinite_temperature", "/v1/completions", b'{"prompt": "x", "temperature": Infinity}',
     "temperature", None),
    ("overflowing_temperature", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}', "temperature", None),
    ("stop_wrong_type", "/v1/completions", {"prompt": "x", "stop": 5}, "stop", None),
    ("stop_list_of_ints", "/v1/chat/completions", {"messages": QUESTION, "stop": [1, 2]}, "stop",
     None),
    ("early_stopping_wrong_type", "/v1/completions", {"prompt": "x", "early_stopping": "x"},
     "early_stopping", None),
    ("json_object_with_beams", "/v1/chat/completions",
     {"messages": QUESTION, "response_format": {"type": "json_object"}, "num_beams": 2},
     "response_format", None),
    ("guided_regex_with_beam_search", "/v1/completions",
     {"prompt": "x", "guided_regex": "[ab]+", "use_beam_search": True, "n": 2}, "guided_regex", None),
    ("out_of_range_top_p", "/v1/chat/completions", {"messages": QUESTION, "top_p": 1.5}, "top_p", None),
    ("out_of_range_n", "/v1/completions", {"prompt": "x", "n": 0}, "n", None),
    ("truncation_over_context", "/v1/completions",
     {"prompt": "x", "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens", None),
    ("chat_truncation_over_context", "/v1/chat/completions",
     {"messages": QUESTION, "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens", None),
    ("embeddings_truncation_over_context", "/v1/embeddings",
     {"input": "x", "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens", None),
    ("n_over_openai_limit", "/v1/chat/completions", {"messages": QUESTION, "n": 129}, "n", None),
    ("best_of_over_cap", "/v1/completions", {"prompt": "x", "best_of": 17}, "best_of", None),
    ("num_beams_over_cap", "/v1/completions", {"prompt": "x", "num_beams": 17}, "num_beams", None),
    # More prompts than OpenAI takes in a list: the prompt list is named, n = 1 is not to blame.
    ("prompt_list_over_limit", "/v1/completions", {"prompt": ["x"] * 2049}, "prompt", None),
    ("prompts_times_n_over_limit", "/v1/completions", {"prompt": ["x"] * 1025, "n": 2}, "n", None),
    ("max_tokens_zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ("min_over_max", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, "min_tokens", None),
    ("empty_prompt", "/v1/completions", {"prompt": ""}, "prompt", "empty_prompt"),
    ("empty_prompt_list", "/v1/completions", {"prompt": []}, "prompt", None),
    ("empty_prompt_in_list", "/v1/completions", {"prompt": ["ok", ""]}, "prompt", "empty_prompt"),
    ("missing_prompt", "/v1/completions", {"max_tokens": 3}, "prompt", None),
    ("empty_messages", "/v1/chat/completions", {"messages": []}, "messages", None),
    ("bad_token_id", "/v1/completions", {"prompt": [1, 49152]}, "prompt", "invalid_token_id"),
    ("negative_token_id", "/v1/completions", {"prompt": [-1]}, "prompt", "invalid_token_id"),
    ("bad_stop_token_id", "/v1/completions", {"prompt": "x", "stop_token_ids": [10**7]}, "stop_token_ids",
     "invalid_token_id"),
    ("over_context", "/v1/completions", {"prompt": "x", "max_tokens": 5000}, "prompt",
     "context_length_exceeded"),
    ("over_context_stream", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 5000, "stream": True},
     "messages", "context_length_exceeded"),
    ("logit_bias_out_of_vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"49152": 5}}, "logit_bias",
     "invalid_token_id"),
    ("logit_bias_out_of_range", "/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias", None),
    ("best_of_below_n", "/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of", None),
    ("best_of_streamed", "/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, "best_of", None),
    ("unsupported_suffix", "/v1/completions", {"prompt": "x", "suffix": "!"}, "suffix", "unsupported_parameter"),
    ("malformed_tool", "/v1/chat/completions", {"messages": QUESTION, "tools": [{"type": "function"}]},
     "tools.0.function", None),
    ("json_schema_without_name", "/v1/chat/completions",
     {"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {
         "schema": {"type": "object"}}}},
     "response_format.json_schema.name", None),
    ("json_schema_without_schema", "/v1/chat/completions",
     {"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", None),
    ("top_logprobs_over_cap", "/v1/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", None),
    ("unsupported_functions", "/v1/chat/completions", {"messages": QUESTION, "functions": [{"name": "f"}]},
     "functions", "unsupported_parameter"),
    ("unknown_field", "/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ("request_chat_template", "/v1/chat/completions", {"messages": QUESTION, "chat_template": "{{ 7*7 }}"},
     "chat_template", "unsupported_parameter"),
    ("image_content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0", None),
    ("empty_cache_salt", "/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt", None),
    ("priority_without_priority_policy", "/v1/chat/completions", {"messages": QUESTION, "priority": 1},
     "priority", None),
    ("stream_options_without_stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options", None),
]


@pytest.mark.parametrize("route,body,param,code", [b[1:] for b in BAD_REQUESTS],
                         ids=[b[0] for b in BAD_REQUESTS])
def test_400_invalid_input(server, route, body, param, code):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + route, timeout=30, **kwargs)
    assert r.status_code == 400, r.text
    error = openai_error(r)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code, error


def test_scoring_a_prompt_that_fills_the_context_says_why_it_does_not_fit(server):
    """echo with max_tokens 0 generates one token for the engine, which the client did not
    ask for: a prompt of the whole context is refused saying so, not "you requested N + 1"."""
    limit = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": [1] * limit, "max_tokens": 0, "echo": True}, timeout=30)
    error = openai_error(r)
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
    assert error["param"] == "prompt" and f"takes at most {limit - 1}" in error["message"]


def test_n_and_prompt_lists_up_to_openai_limits(client, model_name):
    """OpenAI takes n up to 128 and long prompt lists; within max_num_seqs (256 here) and the
    queue, so does the server: n = 20 on a chat, 80 prompts in one completion."""
    chat = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1,
                                          n=20, temperature=1, seed=3)
    assert sorted(c.index for c in chat.choices) == list(range(20))
    batch = client.completions.create(model=model_name, prompt=[f"{i} +" for i in range(80)],
                                      max_tokens=1, temperature=0)
    assert sorted(c.index for c in batch.choices) == list(range(80))


def test_400_with_openai_client(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=5000)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in info.value.message


def test_404_unknown_model(server, client):
    r = httpx.post(server.base_url + "/completions", json={"model": "gpt-17", "prompt": "x"})
    assert r.status_code == 404
    assert openai_error(r) == {"message": "The model `gpt-17` does not exist.", "type": "invalid_request_error",
                         "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=QUESTION)
    # models.retrieve: the listed card, or the same 404 (a name with a slash too).
    listed = client.models.list().data[0]
    assert client.models.retrieve(listed.id) == listed
    for name in ("gpt-17", "org/gpt-17"):
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve(name)
        assert info.value.code == "model_not_found" and name in info.value.message
    # A route that does not exist, answered as OpenAI answers it.
    r = httpx.post(server.base_url + "/chat/complete", json={})
    assert r.status_code == 404 and openai_error(r) == {
        "message": "Invalid URL (POST /v1/chat/complete)", "type": "invalid_request_error",
        "param": None, "code": None}


def test_413_body_too_large(server):
    big = {"prompt": "x" * (MAX_BODY + 10)}
    r = httpx.post(server.base_url + "/completions", json=big)
    assert r.status_code == 413
    assert openai_error(r)["code"] == "request_too_large"

    def chunked():  # no Content-Length: the size must be counted as it arrives
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 8192):
            yield payload[i:i + 8192]

    r = httpx.post(server.base_url + "/completions", content=chunked(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and openai_error(r)["code"] == "request_too_large"


def test_401_api_key(default_model_dir):
    proc = ServerProcess([*KV_ARGS, "--api-key", "s3cret"])
    try:
        for probe in ("/health", "/ping"):
            assert httpx.get(proc.url + probe).status_code == 200  # open for probes
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                                 ("POST", "/tokenize"), ("GET", "/version"),
                                 ("POST", "/reset_prefix_cache")):
                r = httpx.request(method, proc.url + path, headers=headers, json={"prompt": "x"})
                assert r.status_code == 401, (path, headers)
                assert openai_error(r) == {"message": "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                                     "type": "authentication_error", "param": None,
                                     "code": "invalid_api_key"}
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=proc.base_url, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=proc.base_url, api_key="s3cret", max_retries=0)
        name = good.models.list().data[0].id
        out = good.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2
    finally:
        proc.stop()


def test_429_queue_full_with_retry_after(default_model_dir):
    # (--disable-log-stats wins over an interval: no stats line, however busy it gets.)
    proc = ServerProcess([*KV_ARGS, "--max-num-seqs", "1", "--max-queue-size", "1",
                          "--disable-log-stats", "--log-stats-interval", "0.2"])
    try:
        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=proc.base_url, timeout=120) as http:
                body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
                return await asyncio.gather(*(http.post("/completions", json=body) for _ in range(8)))

        responses = asyncio.run(flood())
        statuses = sorted(r.status_code for r in responses)
        # One request runs, one waits (queue of 1), the other six are refused; none is lost.
        assert statuses == [200] * 2 + [429] * 6, statuses
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1
                error = openai_error(r)
                assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "queue_full", None)
            else:
                assert r.json()["usage"]["completion_tokens"] == 24
        # Serial requests are never throttled.
        for _ in range(2):
            assert httpx.post(proc.base_url + "/completions", timeout=60,
                              json={"prompt": "x", "max_tokens": 2}).status_code == 200
        assert "Avg prompt throughput" not in proc.log()
        assert "Received request" not in proc.log()  # (--enable-log-requests: off by default)
    finally:
        proc.stop()


# ---- requests larger than the queue ------------------------------------------------------------

@pytest.fixture(scope="module")
def small_server(default_model_dir):
    """Two sequence slots and a queue of two: the engine takes at most four requests at once."""
    proc = ServerProcess([*KV_ARGS, "--max-num-seqs", "2", "--max-queue-size", "2"])
    yield proc
    proc.stop()


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}, "prompt"),
], ids=["completions_prompts"])
def test_400_for_more_engine_requests_than_the_server_ever_takes(small_server, route, body, param):
    """Submitted all or none, five requests never fit 2 + 2: a 429 would come back on every
    retry, even on an idle server. It is a 400 naming the limit, before anything runs."""
    for _ in range(2):
        r = httpx.post(small_server.url + route, json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = openai_error(r)
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert "max_num_seqs + max_queue_size = 2 + 2 = 4" in error["message"], error
    health = httpx.get(small_server.url + "/health").json()
    assert (health["num_running"], health["num_waiting"]) == (0, 0)
    fits = httpx.post(small_server.base_url + "/completions", timeout=120,
                      json={"prompt": ["a", "b", "c", "d"], "max_tokens": 2})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4
    # n sequences of one prompt are one engine request, whose sequences run side by side: more
    # than max_num_seqs is a 400 naming the key, on /generate as on /v1/completions.
    for route, body, param in [
            ("/generate", {"prompt": "a", "stream": False, "sampling_config": {
                "num_return_sequences": 3, "max_new_tokens": 2}},
             "sampling_config.num_return_sequences"),
            ("/v1/completions", {"prompt": "a", "n": 3, "max_tokens": 2}, "n")]:
        r = httpx.post(small_server.url + route, json=body, timeout=60)
        assert r.status_code == 400 and openai_error(r)["param"] == param, r.text
    two = httpx.post(small_server.url + "/generate", timeout=120, json={
        "prompt": "a", "stream": False, "sampling_config": {
            "num_return_sequences": 2, "max_new_tokens": 2}})
    assert two.status_code == 200 and len(two.json()["output_token_ids"]) == 2


def test_forward_only_requests_larger_than_the_queue_wait_for_room(small_server):
    """/v1/embeddings and /forward queue their inputs as room frees (as Engine.embed does):
    more inputs than the engine takes at once are answered, in order."""
    texts = [f"text number {i}" for i in range(11)]
    r = httpx.post(small_server.base_url + "/embeddings", timeout=120,
                   json={"input": texts, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(texts)))
    for i in (0, len(texts) - 1):
        alone = httpx.post(small_server.base_url + "/embeddings", timeout=60,
                           json={"input": texts[i], "encoding_format": "float"}).json()
        assert data[i]["embedding"] == pytest.approx(alone["data"][0]["embedding"], abs=1e-4)
    requests = [{"input_tokens": [1, 2 + i], "request_target": [
        {"target_name": "logits", "slice_pos": [[-1, -1]], "token_reduce_mode": "GATHER_TOKEN_ID",
         "token_id": [5]}]} for i in range(7)]
    r = httpx.post(small_server.url + "/forward", json={"requests": requests}, timeout=120)
    assert r.status_code == 200, r.text
    assert [out["input_token_ids"] for out in r.json()["responses"]] == \
        [req["input_tokens"] for req in requests]


# ---- the app in-process: engine death --------------------------------------------------------------

def test_503_when_engine_dead(default_model):
    from ksana_llm.server.app import build_app

    engine = kt.Engine(default_model, num_device_blocks=16)
    app = build_app(engine, served_model_name="m", mount_extensions=False)

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 200
            engine.shutdown()
            assert (await http.get("/health")).status_code == 503
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503
            assert openai_error(r)["type"] == "service_unavailable"
            assert (await http.post("/reset_prefix_cache")).status_code == 503

    asyncio.run(main())


def test_500_carries_the_request_id_and_logs_it(default_model, caplog):
    """An unhandled error: a 500 with the OpenAI body and no details, its x-request-id (which
    Starlette's error answer, sent from outside every middleware, would lack) in the header and
    in the log line that holds the details."""
    from ksana_llm.server.app import build_app

    engine = kt.Engine(default_model, num_device_blocks=16)
    app = build_app(engine, served_model_name="m", mount_extensions=False)

    async def boom() -> None:
        raise RuntimeError("a bug with /secret/path in it")

    app.add_api_route("/boom", boom, methods=["GET"])

    async def main() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            r = await http.get("/boom", headers={"X-Request-Id": "trace-500"})
            assert r.status_code == 500 and r.headers["x-request-id"] == "trace-500"
            assert openai_error(r)["type"] == "internal_error" and "secret" not in r.text
            fresh = await http.get("/boom")
            assert fresh.status_code == 500 and len(fresh.headers["x-request-id"]) == 32

    try:
        with caplog.at_level("ERROR", logger="ksana_llm.server"):
            asyncio.run(main())
    finally:
        engine.shutdown()
    assert any("trace-500" in r.getMessage() and r.exc_info for r in caplog.records)


def test_503_when_waiting_timeout_expires(default_model):
    from ksana_llm.server.app import build_app

    engine = kt.Engine(default_model, num_device_blocks=64, max_num_seqs=1, waiting_timeout_ms=300)
    app = build_app(engine, served_model_name="m", mount_extensions=False)

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            long = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}
            first = asyncio.create_task(http.post("/v1/completions", json=long))
            await asyncio.sleep(0.2)  # the first request holds the only sequence slot
            late = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert late.status_code == 503 and "waiting_timeout_ms" in openai_error(late)["message"]
            assert (await first).status_code == 200

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_cancelled_waits_leave_no_unretrieved_exception(caplog):
    """A client that leaves a non-streamed request cancels the gather of its choices; asyncio
    used to log that gather's CancelledError as "exception was never retrieved" each time."""
    import asyncio
    import gc

    from ksana_llm.server.generation import _cancel

    async def leave() -> None:
        loop = asyncio.get_running_loop()
        pending = [loop.create_future() for _ in range(2)]

        async def wait(future):
            return await future

        results = asyncio.gather(*(wait(f) for f in pending))
        await asyncio.sleep(0)
        _cancel(results)
        await asyncio.sleep(0.05)
        assert results.done()

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(leave())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
