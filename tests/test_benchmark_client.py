"""The load client (`ksana_llm.bench`: `ksana-llm bench`, `benchmarks/benchmark_throughput.py`):
runs against a fake ASGI server for each backend and streaming mode, CSV output, failed streams,
the load's shape, and `ksana-llm bench` against a real server (its pure pieces, decoders and
statistics: tests/test_benchmark_stream_stats.py; input files and KsanaLLM's flags:
tests/test_benchmark_flags.py)."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ksana_llm.bench.client import (
    BenchConfig,
    main,
    run_benchmark,
)
from ksana_llm.bench.request_bodies import build_request
from ksana_llm.bench.results import summarize, write_perf_csv
from ksana_llm.bench.stream import error_message

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CSV = str(REPO / "ksana_llm" / "bench" / "sample_prompts.csv")


# ---- in-process run against a fake server --------------------------------------------------------

WORDS = ["Par", "is", "."]


async def fake_app(scope, receive, send):
    """A minimal ASGI server speaking both APIs, so the request/stream plumbing is exercised."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path == "/v1/models":
        chunks, ctype = [json.dumps({"data": [{"id": "fake-model"}]}).encode()], "application/json"
    else:
        req = json.loads(body)
        if path == "/v1/completions":
            assert req["model"] == "fake-model"
            if req["stream"]:
                events = [{"choices": [{"text": w}]} for w in WORDS]
                events.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
                chunks = [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
                ctype = "text/event-stream"
            else:
                chunks = [json.dumps({"choices": [{"text": "".join(WORDS)}],
                                      "usage": {"prompt_tokens": 4, "completion_tokens": 3}}).encode()]
                ctype = "application/json"
        else:
            full = {"texts": ["".join(WORDS)], "output_token_ids": [[1, 2, 3]],
                    "input_token_ids": [9, 9, 9, 9]}
            if req["stream"]:
                chunks = [json.dumps({"texts": ["".join(WORDS[:i])], "output_token_ids": [[1] * i]}
                                     ).encode() + b"\0" for i in (1, 2, 2, 3)]
            else:
                chunks = [json.dumps(full).encode()]
            ctype = "application/json"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", ctype.encode())]})
    for chunk in chunks:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("backend", ["openai", "ksana"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_run_against_fake_server(backend, stream, mode):
    cfg = BenchConfig(backend=backend, stream=stream, mode=mode, concurrency=2, request_rate=100.0)
    used, results, duration = asyncio.run(
        run_benchmark(cfg, ["a", "b", "c"], transport=httpx.ASGITransport(app=fake_app)))
    assert duration > 0 and len(results) == 3
    assert sorted(r.index for r in results) == [0, 1, 2]
    for r in results:
        assert r.ok, r.error
        assert r.output == "Paris." and r.output_tokens == 3
        if backend == "openai" or not stream:
            assert r.input_tokens == 4
        if stream:
            assert len(r.chunk_times) == 3  # the repeated cumulative ksana chunk is no new token
    if backend == "openai":
        assert used.model == "fake-model"


def _sse_app(events: list[dict]):
    """A fake OpenAI server that streams `events`, then [DONE], to every request."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for event in events:
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"data: {json.dumps(event)}\n\n".encode()})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    return app


@pytest.mark.parametrize("events, arrivals, text", [
    # An answer of EOS alone: one chunk of empty text, still the first (and only) token.
    ([{"choices": [{"text": "", "finish_reason": "stop"}]},
      {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}], 1, ""),
    # Chat: the opening role announcement comes before any token; a chunk of empty content
    # (a stop string held back, EOS) is a token arriving.
    ([{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
      {"choices": [{"delta": {"content": "A"}}]},
      {"choices": [{"delta": {}, "finish_reason": "stop"}]}], 2, "A"),
])
def test_openai_stream_arrivals_count_chunks_of_empty_text(events, arrivals, text):
    cfg = BenchConfig(backend="openai", stream=True, model="fake-model")
    _, (result,), _ = asyncio.run(
        run_benchmark(cfg, ["a"], transport=httpx.ASGITransport(app=_sse_app(events))))
    assert result.ok, result.error
    assert len(result.chunk_times) == arrivals and result.output == text
    assert result.ttft is not None and result.ttft > 0


def test_http_errors_are_recorded_not_raised():
    async def refuse(scope, receive, send):
        await send({"type": "http.response.start", "status": 429, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": {"message": "full"}}'})

    cfg = BenchConfig(backend="ksana")
    _, results, _ = asyncio.run(run_benchmark(cfg, ["a"], transport=httpx.ASGITransport(app=refuse)))
    assert results[0].error.startswith("HTTP 429")


def test_main_writes_csvs_and_reports_unreachable_server(tmp_path, capsys):
    perf, out = tmp_path / "perf.csv", tmp_path / "out.csv"
    code = main(["--host", "127.0.0.1", "--port", "9", "--backend", "ksana", "--prompt_num", "2",
                 "--client_timeout", "2",
                 "--perf_csv", str(perf), "--output_csv", str(out)])
    assert code == 1  # every request failed: nothing listens on port 9
    rows = list(csv.reader(perf.open()))
    assert rows[0][0] == "Request rate" and len(rows) == 2
    assert len(list(csv.reader(out.open()))) == 3
    assert "Request throughput" in capsys.readouterr().out


def test_write_perf_csv_format(tmp_path):
    path = tmp_path / "perf.csv"
    write_perf_csv(path, {"Request rate": 2.0, "Avg latency": 0.123456789})
    assert path.read_text().splitlines() == ["Request rate,Avg latency", "2.00000,0.12346"]




def test_token_id_prompts_and_per_request_lengths():
    """The offline workload travels as token ids with each request's own output length."""
    path, body = build_request(BenchConfig(backend="ksana"), [5, 6, 7], 9)
    assert path == "/generate" and body["input_tokens"] == [5, 6, 7]
    assert body["sampling_config"]["max_new_tokens"] == 9 and "prompt" not in body
    path, body = build_request(BenchConfig(backend="openai", max_new_tokens=100), [5, 6], 3)
    assert path == "/v1/completions" and body["prompt"] == [5, 6] and body["max_tokens"] == 3
    _, body = build_request(BenchConfig(backend="openai", max_new_tokens=100), "text")
    assert body["max_tokens"] == 100


def test_token_id_prompts_count_no_input_chars():
    """A prompt sent as token ids has no characters: "Avg input chars" leaves it out (it was
    the length of its "<N token ids>" placeholder)."""
    cfg = BenchConfig(backend="openai", stream=False)
    transport = httpx.ASGITransport(app=fake_app)
    _, by_ids, duration = asyncio.run(run_benchmark(cfg, [[5] * 40, [6] * 40], transport=transport))
    assert all(r.ok and not r.prompt_is_text for r in by_ids)
    row = summarize(by_ids, duration, request_rate=math.inf, concurrency=None, percentiles=(50,),
                    stream=False)
    assert math.isnan(row["Avg input chars"]) and row["Avg input tokens"] == 4
    _, by_text, duration = asyncio.run(run_benchmark(cfg, ["abc", "abcde"], transport=transport))
    row = summarize(by_text, duration, request_rate=math.inf, concurrency=None,
                    percentiles=(50,), stream=False)
    assert row["Avg input chars"] == 4


# ---- failed streams and error answers ------------------------------------------------------------

def _error_app(body_chunks, status=200):
    """An ASGI app answering every POST with these chunks (after a 200, as the server does when
    the engine fails mid-stream)."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/v1/models":
            body_chunks_ = [json.dumps({"data": [{"id": "m"}]}).encode()]
        else:
            body_chunks_ = body_chunks
        await send({"type": "http.response.start", "status": status, "headers": []})
        for chunk in body_chunks_:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    return app


ENGINE_ERROR = {"error": {"message": "the engine failed while serving this request",
                          "type": "server_error", "param": None, "code": None}}


@pytest.mark.parametrize("backend, stream, chunks", [
    # /generate: tokens arrive, then the error chunk the server sends after its 200
    ("ksana", True, [json.dumps({"texts": ["Hi"], "output_token_ids": [[1, 2]],
                                 "input_token_ids": [5]}).encode() + b"\0",
                     json.dumps(ENGINE_ERROR).encode() + b"\0"]),
    ("ksana", False, [json.dumps(ENGINE_ERROR).encode()]),
    ("openai", True, [b'data: {"choices": [{"text": "Hi"}]}\n\n',
                      f"data: {json.dumps(ENGINE_ERROR)}\n\n".encode(), b"data: [DONE]\n\n"]),
    ("openai", False, [json.dumps(ENGINE_ERROR).encode()]),
])
def test_error_in_a_200_answer_fails_the_request(backend, stream, chunks):
    cfg = BenchConfig(backend=backend, stream=stream)
    _, results, duration = asyncio.run(
        run_benchmark(cfg, ["a", "b"], transport=httpx.ASGITransport(app=_error_app(chunks))))
    assert [r.ok for r in results] == [False, False]
    assert "the engine failed while serving this request" in results[0].error
    row = summarize(results, duration, request_rate=math.inf, concurrency=1, percentiles=(50,),
                    stream=stream)
    assert row["Failed requests"] == 2 and row["Successful requests"] == 0


@pytest.mark.parametrize("backend, chunks, message", [
    ("ksana", [], "the stream ended without a result"),
    ("openai", [], "the stream ended without [DONE]"),
    ("openai", [b'data: {"choices": [{"text": "Hi"}]}\n\n'], "the stream ended without [DONE]"),
])
def test_a_stream_cut_off_or_empty_fails_the_request(backend, chunks, message):
    """A 200 whose stream holds no result (/generate always ends with one) or stops before
    [DONE] is not a finished request."""
    cfg = BenchConfig(backend=backend, stream=True)
    _, results, _ = asyncio.run(
        run_benchmark(cfg, ["a"], transport=httpx.ASGITransport(app=_error_app(chunks))))
    assert not results[0].ok and results[0].error == message


def test_error_message_reads_error_objects():
    assert error_message(ENGINE_ERROR) == "the engine failed while serving this request"
    assert error_message({"error": "boom"}) == "boom"
    assert error_message({"texts": ["x"]}) is None and error_message([1]) is None


# ---- load shape ----------------------------------------------------------------------------------

def _slow_ksana_app(state):
    """/generate answering after 50 ms, recording how many requests were in flight at most."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        state["count"] += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(
            {"texts": ["x"], "output_token_ids": [[1]], "input_token_ids": [1]}).encode()})
    return app


@pytest.mark.parametrize("mode, concurrency, max_concurrency, expected_max", [
    ("async", 1, None, 6),    # open loop at an infinite rate: everything at once
    ("async", 1, 2, 2),       # --max_concurrency caps what is in flight
    ("sync", 3, None, 3),     # closed loop: --concurrency workers
    ("sync", 1, None, 1),     # KsanaLLM's sync mode: one after the other
])
def test_requests_in_flight(mode, concurrency, max_concurrency, expected_max):
    state = {"now": 0, "max": 0, "count": 0}
    cfg = BenchConfig(mode=mode, concurrency=concurrency, max_concurrency=max_concurrency)
    _, results, _ = asyncio.run(run_benchmark(
        cfg, list("abcdef"), transport=httpx.ASGITransport(app=_slow_ksana_app(state))))
    assert all(r.ok for r in results) and state["max"] == expected_max


def test_warmup_is_not_measured_and_repeats_pool():
    state = {"now": 0, "max": 0, "count": 0}
    cfg = BenchConfig(warmup_num_iters=2, repeat_num_iters=3)
    _, results, duration = asyncio.run(run_benchmark(
        cfg, ["a", "b"], transport=httpx.ASGITransport(app=_slow_ksana_app(state))))
    assert state["count"] == 2 * 2 + 3 * 2 and len(results) == 3 * 2
    row = summarize(results, duration, request_rate=math.inf, concurrency=1, percentiles=(50,),
                    stream=False, passes=3)
    assert row["Total latency"] == pytest.approx(duration / 3)  # one pass, as KsanaLLM reports
    assert row["Request throughput"] == pytest.approx(6 / duration)




# ---- `ksana-llm bench` ----------------------------------------------------------------------------

def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ksana_llm.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_ksana_llm_bench_help():
    done = _cli("bench", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ksana-llm bench")
    for flag in ("--model_type", "--topk", "--warmup_num_iters", "--random", "--percentiles"):
        assert flag in done.stdout
    top = _cli("--help")
    assert top.returncode == 0 and "bench" in top.stdout and "load-test" in top.stdout


@pytest.fixture(scope="module")
def server(default_model_dir):
    from tests.server_process import ServerProcess

    proc = ServerProcess(["--num-device-blocks", "128"])
    yield proc
    proc.stop()


@pytest.mark.parametrize("backend, extra", [
    ("ksana", ["--model_type", "empty", "--mode", "async", "--random", "--request_rate", "20"]),
    ("openai", ["--mode", "sync", "--concurrency", "2", "--stop_strings", "zzz"]),
])
def test_ksana_llm_bench_against_a_real_server(server, backend, extra, tmp_path):
    perf = tmp_path / "perf.csv"
    done = _cli("bench", "--host", "127.0.0.1", "--port", str(server.port), "--backend", backend,
                "--input_csv", SAMPLE_CSV, "--prompt_num", "3", "--max_new_tokens", "4",
                "--stream", "--topk", "1", "--topp", "1.0", "--repetition_penalty", "1.0",
                "--percentiles", "50", "99", "--perf_csv", str(perf), *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    header, values = list(csv.reader(perf.open()))
    row = dict(zip(header, map(float, values)))
    assert row["Successful requests"] == 3 and row["Failed requests"] == 0, row
    assert 1 <= row["Avg output tokens"] <= 4 and row["Avg input tokens"] > 0, row
    assert row["P99 TTFT"] >= row["P50 TTFT"] > 0


def test_clear_cache_empties_the_servers_prefix_cache_before_each_pass(server, tmp_path):
    """--clear_cache (KsanaLLM's flag): each measured pass starts with the server's prefix cache
    empty, so the second pass of the same prompts finds none of the first one's blocks."""
    def cache_hits() -> int:
        return httpx.get(server.url + "/v1/stats", timeout=10).json()["num_prefix_cache_hits"]

    before = cache_hits()
    done = _cli("bench", "--host", "127.0.0.1", "--port", str(server.port), "--input_csv",
                SAMPLE_CSV, "--prompt_num", "3", "--max_new_tokens", "16", "--ignore_eos",
                "--mode", "sync", "--repeat_num_iters", "2", "--clear_cache",
                "--perf_csv", str(tmp_path / "p.csv"))
    assert done.returncode == 0, done.stdout + done.stderr
    dropped = [int(n) for n in re.findall(r"--clear_cache: prefix cache emptied \((\d+) blocks "
                                          r"dropped\)", done.stderr)]
    assert len(dropped) == 2 and dropped[1] > 0, done.stderr  # the first pass's blocks
    assert cache_hits() == before  # no prompt found another's (or its own earlier) blocks
