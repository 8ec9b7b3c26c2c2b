"""Metrics of a real `ksana-llm serve` process: each HTTP request counted once by how it ended
(refused part way, timed out, client gone, 401, 413), and the per-request series the server feeds
from each engine request's config (n, max_tokens) beside the engine's step histogram."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from ksana_llm.server.metrics import FAILURE_REASONS
from tests.prometheus_samples import samples
from tests.server_process import ServerProcess

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024
WAITING_TIMEOUT_MS = 3000
HOLDER_PROMPT = list(range(1000, 1008))  # 8 prompt tokens


@pytest.fixture(scope="module")
def server(default_model_dir):
    """One sequence slot and a queue of two, so a held slot makes requests wait."""
    proc = ServerProcess(["--num-device-blocks", "256", "--max-num-seqs", "1",
                          "--max-queue-size", "2", "--waiting-timeout-ms",
                          str(WAITING_TIMEOUT_MS), "--api-key", KEY,
                          "--max-body-bytes", str(MAX_BODY)])
    yield proc
    proc.stop()


def scrape(server: ServerProcess) -> dict[tuple[str, frozenset], float]:
    return samples(httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (f"ksana_llm:{name}", frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_until(server: ServerProcess, running: int, waiting: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(server.url + "/health", timeout=10).json()
        if (health["num_running"], health["num_waiting"]) == (running, waiting):
            return
        assert time.monotonic() < deadline, f"server did not reach {running}/{waiting}: {health}"
        time.sleep(0.05)


@contextmanager
def holding_the_slot(server: ServerProcess) -> Iterator[None]:
    """A streamed request that takes the only sequence slot until the block ends; it then
    leaves (counted as one finished request, reason "abort", with HOLDER_PROMPT's tokens)."""
    started, stop = threading.Event(), threading.Event()

    def hold() -> None:
        body = {"prompt": HOLDER_PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base_url + "/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            for line in r.iter_lines():
                started.set()
                if stop.is_set():
                    return

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        assert started.wait(60), "the holding request never started"
        wait_until(server, 1, 0)
        yield
    finally:
        stop.set()
        thread.join(60)
        wait_until(server, 0, 0)
        time.sleep(0.2)  # the abort's output reaches the metrics right after the step


def only_the_holder_finished(before: dict, after: dict) -> None:
    assert delta(before, after, "request_success_total", finished_reason="abort") == 1
    for reason in ("stop", "length"):
        assert delta(before, after, "request_success_total", finished_reason=reason) == 0
    assert delta(before, after, "prompt_tokens_total") == len(HOLDER_PROMPT)
    assert delta(before, after, "e2e_request_latency_seconds_count") == 1


def test_request_refused_part_way_counts_only_as_queue_full(server):
    """Three prompts: two are queued behind the held slot, the third is refused (429); the two
    queued ones are aborted and must not count as finished requests."""
    before = scrape(server)
    with holding_the_slot(server):
        r = httpx.post(server.base_url + "/completions", headers=AUTH, timeout=60,
                       json={"prompt": [[5, 6, 7], [8, 9, 10], [11, 12, 13]], "max_tokens": 2})
        assert r.status_code == 429, r.text
    after = scrape(server)
    assert delta(before, after, "request_failure_total", reason="queue_full") == 1
    assert sum(delta(before, after, "request_failure_total", reason=r)
               for r in FAILURE_REASONS) == 1
    only_the_holder_finished(before, after)


def test_client_leaving_counts_once_as_abort_and_unscheduled_prompts_not_at_all(server):
    """A streamed and a non-streamed request wait behind the held slot; both clients leave
    before they are scheduled. Each is one finished request with reason "abort" (no failure),
    and neither prompt was prefilled, so neither adds prompt tokens."""
    before = scrape(server)

    async def leave_streaming() -> None:
        body = {"messages": [{"role": "user", "content": "Tell me a story."}], "stream": True,
                "max_tokens": 8}
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            async with http.stream("POST", server.base_url + "/chat/completions",
                                   json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return  # the role chunk came; leave while the request still waits

    async def leave_waiting() -> None:
        async with httpx.AsyncClient(timeout=0.5, headers=AUTH) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(server.base_url + "/completions",
                                json={"prompt": [20, 21, 22, 23], "max_tokens": 8})

    with holding_the_slot(server):
        asyncio.run(leave_streaming())
        asyncio.run(leave_waiting())
        wait_until(server, 1, 0, timeout=WAITING_TIMEOUT_MS / 1000 - 1)  # before any timeout
        time.sleep(0.2)
    after = scrape(server)
    assert delta(before, after, "request_success_total", finished_reason="abort") == 3
    assert all(delta(before, after, "request_failure_total", reason=r) == 0
               for r in FAILURE_REASONS)
    assert delta(before, after, "prompt_tokens_total") == len(HOLDER_PROMPT)


def test_waiting_timeout_counts_as_timeout_streamed_or_not(server):
    before = scrape(server)

    async def both() -> tuple[httpx.Response, str]:
        body = {"prompt": [30, 31, 32], "max_tokens": 4}
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            async def streamed() -> str:
                async with http.stream("POST", server.base_url + "/completions",
                                       json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    return (await r.aread()).decode()

            return await asyncio.gather(http.post(server.base_url + "/completions", json=body),
                                        streamed())

    with holding_the_slot(server):
        plain, stream = asyncio.run(both())
    assert plain.status_code == 503 and "waiting_timeout_ms" in plain.json()["error"]["message"]
    assert '"error"' in stream and stream.endswith("data: [DONE]\n\n")
    after = scrape(server)
    assert delta(before, after, "request_failure_total", reason="timeout") == 2
    assert delta(before, after, "request_failure_total", reason="engine_error") == 0
    only_the_holder_finished(before, after)


def test_server_records_request_parameters_and_engine_steps(server):
    """The server hands each engine request's config to the metrics: n and max_tokens as
    asked; the generated-token histogram agrees with the usage the client got."""
    before = scrape(server)
    body = {"prompt": "Once upon a time", "max_tokens": 4, "n": 1, "ignore_eos": True}
    answer = httpx.post(server.base_url + "/completions", json=body, headers=AUTH, timeout=60)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    time.sleep(0.2)  # the finished output reaches the metrics right after the step
    after = scrape(server)
    assert delta(before, after, "request_params_n_count") == 1
    assert delta(before, after, "request_params_n_bucket", le="1.0") == 1
    assert delta(before, after, "request_params_max_tokens_sum") == 4
    assert delta(before, after, "request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert delta(before, after, "request_generation_tokens_sum") == usage["completion_tokens"]
    assert usage["completion_tokens"] == 4
    # Alone on the server (one sequence slot): a prefill step and three decode steps.
    assert delta(before, after, "iteration_tokens_total_count") == 4
    assert delta(before, after, "iteration_tokens_total_sum") == usage["prompt_tokens"] + 3


def test_forward_only_requests_count_as_pooling_requests(server):
    """Embeddings, scores and /forward count as vLLM counts pooling requests: each input a
    finished request ("stop") with its prompt tokens, nothing generated."""
    before = scrape(server)
    answer = httpx.post(server.base_url + "/embeddings", json={"input": ["one two", "three"]},
                        headers=AUTH, timeout=60)
    assert answer.status_code == 200, answer.text
    tokens = answer.json()["usage"]["prompt_tokens"]
    scored = httpx.post(server.url + "/score", json={"text_1": "a", "text_2": ["b", "c"]},
                        headers=AUTH, timeout=60)
    assert scored.status_code == 200, scored.text
    tokens += scored.json()["usage"]["prompt_tokens"]
    forward = httpx.post(server.url + "/forward", headers=AUTH, timeout=60, json={
        "requests": [{"input_tokens": HOLDER_PROMPT,
                      "request_target": [{"target_name": "layernorm"}]}]})
    assert forward.status_code == 200, forward.text
    tokens += len(HOLDER_PROMPT)
    after = scrape(server)
    assert delta(before, after, "request_success_total", finished_reason="stop") == 2 + 3 + 1
    assert delta(before, after, "prompt_tokens_total") == tokens
    assert delta(before, after, "request_prompt_tokens_sum") == tokens
    assert delta(before, after, "generation_tokens_total") == 0
    assert sum(delta(before, after, "request_failure_total", reason=r)
               for r in FAILURE_REASONS) == 0


def test_401_and_413_are_counted(server):
    before = scrape(server)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.base_url + "/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401
    big = {"prompt": "x" * (MAX_BODY + 10)}
    r = httpx.post(server.base_url + "/completions", json=big, headers=AUTH)
    assert r.status_code == 413
    # Prometheus scrapes without the key (vLLM's and SGLang's /metrics are open too).
    open_scrape = httpx.get(server.url + "/metrics", timeout=30)
    assert open_scrape.status_code == 200, open_scrape.text
    after = samples(open_scrape.text)
    assert delta(before, after, "request_failure_total", reason="unauthorized") == 2
    assert delta(before, after, "request_failure_total", reason="invalid_request") == 1
    assert sum(delta(before, after, "request_failure_total", reason=r)
               for r in FAILURE_REASONS) == 3
