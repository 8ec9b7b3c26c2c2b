"""The load client (`ksana_llm.bench`: `ksana-llm bench`, `benchmarks/benchmark_throughput.py`):
its pure pieces (stream decoders, statistics, arrivals, the rate search, CSV); runs against a fake
ASGI server for each backend and streaming mode; failed streams; and `ksana-llm bench` against a
real server (input files and KsanaLLM's flags: tests/test_benchmark_flags.py)."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ksana_llm.bench.client import (
    BenchConfig,
    build_request,
    main,
    run_benchmark,
)
from ksana_llm.bench.results import (
    RequestResult,
    arrival_offsets,
    next_request_rate,
    percentile,
    summarize,
    write_perf_csv,
)
from ksana_llm.bench.stream import (
    NulChunkDecoder,
    SSEDecoder,
    error_message,
    ksana_chunk_state,
    openai_chunk_text,
)

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CSV = str(REPO / "ksana_llm" / "bench" / "sample_prompts.csv")


# ---- decoders ------------------------------------------------------------------------------------

def test_sse_decoder_handles_arbitrary_splits():
    stream = (b'data: {"a": 1}\n\n: a comment\n\ndata: {"b": 2}\r\n\r\n'
              b'data: line one\ndata: line two\n\ndata: [DONE]\n\n')
    expected = ['{"a": 1}', '{"b": 2}', "line one\nline two", "[DONE]"]
    for size in (1, 3, 7, len(stream)):
        decoder = SSEDecoder()
        events = [e for i in range(0, len(stream), size) for e in decoder.feed(stream[i:i + size])]
        assert events + decoder.flush() == expected, size


def test_sse_decoder_flushes_an_unterminated_event():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: [DONE]") == []
    assert decoder.flush() == ["[DONE]"]
    assert decoder.flush() == []


def test_sse_decoder_keeps_utf8_split_across_reads():
    payload = 'data: {"text": "长城"}\n\n'.encode()
    decoder = SSEDecoder()
    events = [e for b in payload for e in decoder.feed(bytes([b]))]
    assert json.loads(events[0]) == {"text": "长城"}


def test_nul_decoder_splits_cumulative_chunks():
    chunks = [{"texts": ["Hel"], "output_token_ids": [[1]]},
              {"texts": ["Hello"], "output_token_ids": [[1, 2]]}]
    stream = b"".join(json.dumps(c).encode() + b"\0" for c in chunks)
    decoder = NulChunkDecoder()
    got = [c for i in range(0, len(stream), 5) for c in decoder.feed(stream[i:i + 5])]
    assert got == chunks and decoder.flush() == []
    tail = NulChunkDecoder()
    assert tail.feed(b'{"texts": ["x"]}') == [] and tail.flush() == [{"texts": ["x"]}]


def test_chunk_readers():
    assert openai_chunk_text({"choices": [{"text": "hi"}]}) == "hi"
    assert openai_chunk_text({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert openai_chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert ksana_chunk_state({"texts": ["ab"], "output_token_ids": [[5, 6]],
                              "input_token_ids": [1, 2, 3]}) == ("ab", 2, 3)
    assert ksana_chunk_state({"texts": ["ab"], "output_token_ids": [5, 6]}) == ("ab", 2, None)


# ---- statistics ----------------------------------------------------------------------------------

def test_percentile_interpolates_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def result(i, start, chunks, end, n_in, n_out, error=None):
    return RequestResult(i, "p" * 10, start=start, end=end, output="o" * n_out,
                         chunk_times=chunks, input_tokens=n_in, output_tokens=n_out, error=error)


def test_summarize_throughput_latency_ttft_itl_tpot():
    results = [
        result(0, 0.0, [0.5, 0.6, 0.8], 1.0, 10, 3),   # ttft .5, itl .1 .2, tpot .25
        result(1, 1.0, [1.2, 1.5], 2.0, 20, 5),       # ttft .2, itl .3, tpot .2
        result(2, 0.0, [], 0.1, 0, 0, error="HTTP 429"),
    ]
    row = summarize(results, duration=2.0, request_rate=math.inf, concurrency=None,
                    percentiles=(50, 99), stream=True)
    assert row["Request throughput"] == 1.0
    assert row["Token throughput"] == (30 + 8) / 2.0
    assert row["Input token throughput"] == 15.0 and row["Output token throughput"] == 4.0
    assert row["Avg latency"] == 1.0
    assert row["Avg TTFT"] == pytest.approx(0.35)
    assert row["Median ITL"] == pytest.approx(0.2)
    assert row["Avg ITL"] == pytest.approx(0.2)
    assert row["Avg TPOT"] == pytest.approx(0.225)
    assert row["P99 latency"] == pytest.approx(1.0)
    assert row["Failed requests"] == 1 and row["Successful requests"] == 2
    assert list(row)[:10] == ["Request rate", "Concurrency", "Total latency", "Request throughput",
                              "Avg latency", "Avg input chars", "Avg output chars",
                              "Avg input tokens", "Avg output tokens", "Token throughput"]


def test_summarize_without_stream_has_no_ttft():
    row = summarize([result(0, 0.0, [], 1.0, 4, 4)], 1.0, request_rate=2.0, concurrency=4,
                    percentiles=(90,), stream=False)
    assert "Avg TTFT" not in row and row["P90 latency"] == 1.0 and row["Concurrency"] == 4


def test_arrivals_even_poisson_and_bursts():
    assert arrival_offsets(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    # KsanaLLM's default: evenly spaced; --concurrency N sends N together, N / rate apart.
    assert arrival_offsets(4, 2.0) == [0.0, 0.5, 1.0, 1.5]
    assert arrival_offsets(5, 2.0, burst=2) == [0.0, 0.0, 1.0, 1.0, 2.0]
    # --random: a Poisson process (exponential gaps of mean 1 / rate), seeded.
    offsets = arrival_offsets(2000, 10.0, random.Random(0), poisson=True)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert len({round(g, 9) for g in gaps}) > 1000  # not evenly spaced
    assert offsets == arrival_offsets(2000, 10.0, random.Random(0), poisson=True)  # seeded
    bursts = arrival_offsets(2000, 10.0, random.Random(0), burst=4, poisson=True)
    assert bursts[0::4] == bursts[1::4] == bursts[3::4]
    burst_gaps = [b - a for a, b in zip(bursts[::4], bursts[4::4])]
    assert sum(burst_gaps) / len(burst_gaps) == pytest.approx(0.4, rel=0.15)  # rate stays 10/s


def test_request_rate_sweep_and_latency_search():
    def nxt(history, **kw):
        args = dict(start=2.0, step=1.5, num_iters=3, max_avg_latency=math.inf,
                    max_first_token_latency=math.inf, max_rate=64.0)
        return next_request_rate(history, **{**args, **kw})

    # --request_rate_num_iters 3 --request_rate_step 1.5: 2, 3.5, 5, then done.
    assert [nxt([]), nxt([(2, 1, 0)]), nxt([(2, 1, 0), (3.5, 1, 0)])] == [2.0, 3.5, 5.0]
    assert nxt([(2, 1, 0), (3.5, 1, 0), (5, 1, 0)]) is None
    # With a latency bound: double while the highest rate passes (at most max_rate)...
    runs = [(2, 1.0, 0.1), (3.5, 1.5, 0.1), (5, 1.9, 0.1)]
    assert nxt(runs, max_avg_latency=2.0) == 10.0
    assert nxt(runs + [(40, 1.0, 0.1)], max_avg_latency=2.0) == 64.0
    # ... halve while the lowest fails, else the midpoint of best pass and first fail.
    assert nxt(runs, max_avg_latency=0.5) == 1.0
    assert nxt(runs + [(10, 3.0, 0.1)], max_avg_latency=2.0) == 7.5
    assert nxt(runs, max_avg_latency=10.0, max_first_token_latency=0.05) == 1.0  # TTFT bound
    assert nxt(runs + [(10, 3.0, 0.1), (7.5, 3.0, 0.1)], max_avg_latency=2.0) == 6.2
    assert nxt([(0.1, 5.0, 0.0)], num_iters=1, max_avg_latency=1.0) is None  # 0.1 again: stop


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


def test_unreported_token_counts_stay_unknown():
    row = summarize([result(0, 0.0, [0.1], 1.0, None, 2)], 1.0, request_rate=1.0, concurrency=1,
                    percentiles=(50,), stream=True)
    assert math.isnan(row["Avg input tokens"]) and row["Avg output tokens"] == 2


def test_token_id_prompts_and_per_request_lengths():
    """The offline workload travels as token ids with each request's own output length."""
    path, body = build_request(BenchConfig(backend="ksana"), [5, 6, 7], 9)
    assert path == "/generate" and body["input_tokens"] == [5, 6, 7]
    assert body["sampling_config"]["max_new_tokens"] == 9 and "prompt" not in body
    path, body = build_request(BenchConfig(backend="openai", max_new_tokens=100), [5, 6], 3)
    assert path == "/v1/completions" and body["prompt"] == [5, 6] and body["max_tokens"] == 3
    _, body = build_request(BenchConfig(backend="openai", max_new_tokens=100), "text")
    assert body["max_tokens"] == 100


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


def test_decode_token_throughput():
    results = [result(0, 0.0, [], 1.0, 10, 5), result(1, 0.0, [], 1.0, 10, 1)]
    plain = summarize(results, 2.0, request_rate=1.0, concurrency=1, percentiles=(50,),
                      stream=False)
    decode = summarize(results, 2.0, request_rate=1.0, concurrency=1, percentiles=(50,),
                       stream=False, decode_token_throughput=True)
    assert plain["Token throughput"] == 26 / 2.0 and plain["Decode token throughput"] == 4 / 2.0
    assert decode["Token throughput"] == 4 / 2.0


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
