"""The OpenAI-compatible server's small routes (health and /ping, /load, models, version,
tokenizer, /invocations, /reset_prefix_cache), the periodic stats line, abort on client disconnect and the Prometheus metrics, on a real
subprocess driven by `httpx` and the official `openai` client (generation:
tests/test_server_openai.py; errors: tests/test_server_errors.py)."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

import ksana_llm as kt
from tests.server_process import ServerProcess, openai_error

KV_ARGS = ["--num-device-blocks", "256"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


@pytest.fixture(scope="module")
def server(default_model_dir):
    # default_model_dir: the GGUF is converted (and cached) before the server process needs it.
    proc = ServerProcess([*KV_ARGS, "--log-stats-interval", "0.5", "--enable-log-requests",
                          "--enable-log-outputs", "--max-log-len", "12",
                          "--middleware", "tests.server_middlewares:StampHeader",
                          "--middleware", "tests.server_middlewares.stamp_function"])
    yield proc
    proc.stop()


# ---- small routes ----------------------------------------------------------------------------------

def test_health_models_version(server, model_name):
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200
    # KsanaLLM's body ("healthy"), plus the queue counts.
    assert health.json()["status"] == "healthy" and health.json()["num_running"] == 0
    models = httpx.get(server.base_url + "/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [model_name]
    # KsanaLLM serves them without the /v1 prefix too.
    time.sleep(1.1)  # a card's `created` is the server's start, not the call's time
    assert httpx.get(server.url + "/models").json() == models
    assert httpx.get(f"{server.url}/models/{model_name}").json()["id"] == model_name
    assert models["data"][0]["max_model_len"] == 4096  # 256 blocks x 16 tokens
    assert httpx.get(server.url + "/version").json() == {"version": kt.__version__}


def test_tokenize_detokenize(server, local_engine):
    tok = local_engine.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200
    assert r.json() == {"tokens": tok.encode(PROMPT), "count": len(tok.encode(PROMPT)),
                        "max_model_len": 4096, "token_strs": None}  # vLLM's shape
    r = httpx.post(server.url + "/detokenize", json={"tokens": tok.encode(PROMPT)})
    assert r.json() == {"prompt": PROMPT}
    rendered = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    r = httpx.post(server.url + "/tokenize", json={"messages": QUESTION})
    assert r.json()["tokens"] == tok.encode(rendered, add_special_tokens=False)
    r = httpx.post(server.url + "/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400 and openai_error(r)["param"] == "tokens"


def test_ping_is_health(server):
    """vLLM's (and SageMaker's) /ping, GET or POST: /health's answer."""
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/ping")
        assert r.status_code == 200 and r.json() == httpx.get(server.url + "/health").json()


def test_load_counts_the_requests_being_answered(server, client, model_name):
    """vLLM's GET /load: a stream counts until its end, an embedding request while it is
    answered, and the small routes never; 0 again once all are done."""
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    stream = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=40,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    assert httpx.get(server.url + "/load").json() == {"server_load": 1}
    httpx.post(server.url + "/tokenize", json={"prompt": "hi"})
    assert httpx.get(server.url + "/load").json() == {"server_load": 1}
    list(chunks)
    client.embeddings.create(model=model_name, input="Hi")
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}


def test_invocations_picks_the_api_from_the_body(server, model_name):
    """SageMaker's /invocations (vLLM serves it too): each body answered as on its own route."""
    def both(path: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
        return (httpx.post(server.url + "/invocations", json=body, timeout=60),
                httpx.post(server.base_url + path, json=body, timeout=60))

    chat, want = both("/chat/completions", {"messages": QUESTION, "max_tokens": 8,
                                            "temperature": 0})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert chat.json()["choices"] == want.json()["choices"]
    text, want = both("/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert text.json()["object"] == "text_completion"
    assert text.json()["choices"] == want.json()["choices"]
    # The same numbers; their last float bits follow how the two calls' rows were batched.
    def same_up_to_float_noise(got: list[dict], expected: list[dict], number: str) -> None:
        assert [{**d, number: None} for d in got] == [{**d, number: None} for d in expected]
        for a, b in zip(got, expected):
            assert a[number] == pytest.approx(b[number], abs=1e-5)

    vectors, want = both("/embeddings", {"input": ["a", PROMPT]})
    same_up_to_float_noise(vectors.json()["data"], want.json()["data"], "embedding")
    scores, want = both("/score", {"text_1": "a", "text_2": ["a", PROMPT]})
    same_up_to_float_noise(scores.json()["data"], want.json()["data"], "score")
    ranked, want = both("/rerank", {"query": "a", "documents": ["b", PROMPT]})
    same_up_to_float_noise(ranked.json()["results"], want.json()["results"], "relevance_score")
    streamed = httpx.post(server.url + "/invocations", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")
    # Errors are the chosen route's, or name what is missing or ambiguous.
    bad_chat = httpx.post(server.url + "/invocations", json={"messages": [], "max_tokens": 1})
    assert bad_chat.status_code == 400 and openai_error(bad_chat)["param"] == "messages"
    for body, param in (({}, "messages"), ({"prompt": "x", "messages": QUESTION}, "prompt"),
                        ([1, 2], "messages")):
        r = httpx.post(server.url + "/invocations", json=body)
        assert r.status_code == 400 and openai_error(r)["param"] == param, body
    r = httpx.post(server.url + "/invocations", content=b"{not json")
    assert r.status_code == 400 and "JSON" in openai_error(r)["message"]


def test_reset_prefix_cache(server, client, model_name):
    """vLLM's POST /reset_prefix_cache: the next request computes its whole prompt again; a
    request streaming through the reset is not disturbed."""
    messages = [{"role": "user", "content": "Reset: " + "tell me about the hills. " * 12}]

    def cached() -> tuple[int, int]:
        reply = client.chat.completions.create(model=model_name, messages=messages,
                                               max_tokens=1)
        return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens

    _, prompt_tokens = cached()
    full = prompt_tokens // 16 * 16
    assert cached()[0] == full > 0
    assert httpx.post(server.url + "/reset_prefix_cache").json()["num_blocks_dropped"] > 0
    assert cached()[0] == 0
    assert cached()[0] == full  # cached again from the cold run
    want = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24,
                                          temperature=0).choices[0].message.content
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24,
                                            temperature=0, stream=True)
    text = [next(stream).choices[0].delta.content or ""]
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    text += [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(text) == want


def _stats_lines(server) -> list[str]:
    return [line for line in server.log().splitlines() if "Avg prompt throughput" in line]


def test_the_server_logs_its_stats_while_busy(server, client, model_name):
    """vLLM's periodic line (here every 0.5 s; default 10), at the default log level, only
    while there is work."""
    client.completions.create(model=model_name, prompt=PROMPT, max_tokens=40, temperature=0,
                              extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while not any(re.search(r"Avg generation throughput: [1-9]", line)
                  for line in _stats_lines(server)):
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.2)
    line = _stats_lines(server)[-1]
    assert "ksana_llm.stats" in line and "Running: " in line and "KV cache usage: " in line
    time.sleep(1.5)  # the line for the interval the work ended in, if it was not out yet
    idle = len(_stats_lines(server))
    time.sleep(1.5)
    assert len(_stats_lines(server)) == idle


def test_requests_are_logged_with_enable_log_requests(server, client, model_name, local_engine):
    """vLLM's --enable-log-requests: each engine request as it is submitted, its prompt and ids
    cut at --max-log-len (12 here), and the settings it changed."""
    reply = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3,
                                      temperature=0.5, seed=3)
    ids = local_engine.tokenizer.encode(PROMPT)
    logged = [line for line in server.log().splitlines()
              if f"Received request {reply.id}-0:" in line]
    assert len(logged) == 1 and "ksana_llm.requests" in logged[0]
    text = local_engine.tokenizer.decode(ids[:12])[:12]
    assert f"prompt: {text!r}, prompt_token_ids: {ids[:12]}, params: " in logged[0]
    assert "max_new_tokens=3" in logged[0] and "temperature=0.5" in logged[0]
    assert "seed=3" in logged[0] and logged[0].endswith("lora: None")


def test_outputs_are_logged_with_enable_log_outputs(server, client, model_name):
    """vLLM's --enable-log-outputs: each finished request's text, token ids (cut at
    --max-log-len) and finish reason, streamed or not; every sequence of an n > 1 request."""
    reply = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3,
                                      temperature=0, extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    stream = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, n=2,
                                       temperature=1.0, seed=5, stream=True)
    streamed_id = None
    for chunk in stream:
        streamed_id = chunk.id
    deadline = time.monotonic() + 10
    while True:
        log = server.log()
        if f"Generated response {streamed_id}-0 (sequence 1):" in log or \
                time.monotonic() > deadline:
            break
        time.sleep(0.1)
    logged = [line for line in log.splitlines() if f"Generated response {reply.id}-0:" in line]
    assert len(logged) == 1 and "ksana_llm.requests" in logged[0]
    assert logged[0].endswith(f"output: {choice.text[:12]!r}, output_token_ids: "
                              f"{choice.token_ids[:12]}, finish_reason: length")
    for k in range(2):
        assert f"Generated response {streamed_id}-0 (sequence {k}): output: " in log


def test_user_middlewares_run_on_every_answer(server, model_name):
    """vLLM's --middleware: a class and a function, both on every answer (errors included),
    inside the request-id middleware."""
    for answer in (httpx.get(server.url + "/health"),
                   httpx.post(server.base_url + "/completions",
                              json={"model": model_name, "prompt": PROMPT, "max_tokens": 1}),
                   httpx.post(server.base_url + "/completions",
                              json={"model": model_name, "prompt": PROMPT, "max_tokens": -1})):
        assert answer.headers["x-stamp-class"] == "1"
        assert answer.headers["x-stamp-function"] == answer.request.url.path
        assert answer.headers["x-request-id"]
    from ksana_llm.server.middleware import user_middlewares

    for spec, message in (("tests.server_middlewares:NOT_MIDDLEWARE", "not an ASGI middleware "
                                                                      "class or an async"),
                          ("tests.server_middlewares:nope", "has no 'nope'"),
                          ("no_such_module:thing", "cannot import 'no_such_module'")):
        with pytest.raises(ValueError, match=message) as caught:
            user_middlewares([spec])
        assert "--middleware" in str(caught.value)


# ---- disconnects -----------------------------------------------------------------------------------

def _engine_counts(server) -> tuple[int, int]:
    health = httpx.get(server.url + "/health").json()
    return health["num_running"], health["num_waiting"]


def test_disconnect_aborts_requests(server, model_name):
    # Far more tokens than could be generated before the deadline below: only aborts free the engine.
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True}

    async def cut_streams() -> None:
        async def one() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                async with http.stream("POST", server.base_url + "/completions",
                                       json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            seen += 1
                            if seen == 2:
                                return  # leaving the block closes the connection mid-stream

        async def impatient() -> None:  # non-streaming client that gives up
            async with httpx.AsyncClient(timeout=0.5) as http:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(server.base_url + "/completions", json=body)

        await asyncio.gather(*(one() for _ in range(6)), *(impatient() for _ in range(3)))

    asyncio.run(cut_streams())
    deadline = time.monotonic() + 15
    while _engine_counts(server) != (0, 0):
        assert time.monotonic() < deadline, f"requests still live: {_engine_counts(server)}"
        time.sleep(0.1)
    start = time.monotonic()
    out = httpx.post(server.base_url + "/completions", timeout=30,
                     json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert out.status_code == 200 and time.monotonic() - start < 5


# ---- metrics -----------------------------------------------------------------------------------------

def _scrape(server) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def _total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == val for k, val in labels.items()))


def test_metrics_parse_and_add_up(server, client, model_name):
    before = _scrape(server)
    usages = [client.completions.create(model=model_name, prompt=PROMPT, max_tokens=n, temperature=0,
                                         extra_body={"ignore_eos": True}).usage for n in (3, 5)]
    stream = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usages.append([c for c in stream if c.usage is not None][-1].usage)
    time.sleep(0.2)  # the finished-request callback runs on the engine thread
    after = _scrape(server)

    def delta(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert delta("ksana_llm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("ksana_llm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("ksana_llm:request_success_total") == 3
    assert delta("ksana_llm:request_success_total", finished_reason="length") >= 2
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert delta(f"ksana_llm:{hist}_count") == 3, hist
    # One gap per token after the first, for every request, streamed or not.
    assert delta("ksana_llm:inter_token_latency_seconds_count") == sum(
        u.completion_tokens - 1 for u in usages)
    assert _total(after, "ksana_llm:num_requests_running") == 0
    assert _total(after, "ksana_llm:num_kv_blocks") == 256
