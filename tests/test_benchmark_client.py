"""The load client's pure pieces (stream decoders, statistics, arrivals, CSV) and one in-process
run against a fake ASGI server for each backend and streaming mode."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import random

import httpx
import pytest

from benchmarks.benchmark_throughput import (BenchConfig, build_parser, build_request,
                                             config_from_args, main, run_benchmark)
from benchmarks.client_results import (RequestResult, arrival_offsets, percentile, read_prompts,
                                       summarize, write_perf_csv)
from benchmarks.stream_decoding import (NulChunkDecoder, SSEDecoder, ksana_chunk_state,
                                        openai_chunk_text)


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


def test_poisson_arrivals():
    assert arrival_offsets(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(2000, 10.0, random.Random(0))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert offsets == arrival_offsets(2000, 10.0, random.Random(0))  # seeded


# ---- files and flags -----------------------------------------------------------------------------

def test_read_prompts_skips_header_and_cycles(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text('id,question\n1,"a, b"\n2,c\n', encoding="utf-8")
    assert read_prompts(path, col_idx=1) == ["a, b", "c"]
    assert read_prompts(path, col_idx=1, prompt_num=5) == ["a, b", "c", "a, b", "c", "a, b"]
    with pytest.raises(ValueError, match="no column 3"):
        read_prompts(path, col_idx=3)


def test_sample_prompts_file():
    prompts = read_prompts("benchmarks/sample_prompts.csv")
    assert len(prompts) >= 20 and len(set(prompts)) == len(prompts)


def test_flags_and_payloads():
    args = build_parser().parse_args(["--backend", "ksana", "--stream", "--percentiles", "50,90,99",
                                      "--request_rate", "inf", "--max_new_tokens", "8",
                                      "--ignore_eos", "--api-key", "k"])
    cfg = config_from_args(args)
    assert cfg.percentiles == (50.0, 90.0, 99.0) and math.isinf(cfg.request_rate)
    path, body = build_request(cfg, "hi")
    assert path == "/generate"
    assert body == {"prompt": "hi", "stream": True,
                    "sampling_config": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    openai = BenchConfig(backend="openai", stream=True, model="m", max_new_tokens=4)
    path, body = build_request(openai, "hi")
    assert path == "/v1/completions" and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and body["max_tokens"] == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--percentiles", "50,x"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--request_rate", "0"])


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


def test_http_errors_are_recorded_not_raised():
    async def refuse(scope, receive, send):
        await send({"type": "http.response.start", "status": 429, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": {"message": "full"}}'})

    cfg = BenchConfig(backend="ksana")
    _, results, _ = asyncio.run(run_benchmark(cfg, ["a"], transport=httpx.ASGITransport(app=refuse)))
    assert results[0].error.startswith("HTTP 429")


def test_main_writes_csvs_and_reports_unreachable_server(tmp_path, capsys):
    perf, out = tmp_path / "perf.csv", tmp_path / "out.csv"
    code = main(["--port", "9", "--backend", "ksana", "--prompt_num", "2", "--client_timeout", "2",
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
    from benchmarks.benchmark_throughput import BenchConfig, build_request

    path, body = build_request(BenchConfig(backend="ksana"), [5, 6, 7], 9)
    assert path == "/generate" and body["input_tokens"] == [5, 6, 7]
    assert body["sampling_config"]["max_new_tokens"] == 9 and "prompt" not in body
    path, body = build_request(BenchConfig(backend="openai", max_new_tokens=100), [5, 6], 3)
    assert path == "/v1/completions" and body["prompt"] == [5, 6] and body["max_tokens"] == 3
    _, body = build_request(BenchConfig(backend="openai", max_new_tokens=100), "text")
    assert body["max_tokens"] == 100
