"""The load client's pure pieces (`ksana_llm.bench`): the stream decoders and chunk readers, and
the statistics (percentiles, throughput / TTFT / ITL / TPOT, arrivals, the rate search); its
runs against servers: tests/test_benchmark_client.py."""

from __future__ import annotations

import json
import math
import random

import pytest

from ksana_llm.bench.results import (
    RequestResult,
    arrival_offsets,
    next_request_rate,
    percentile,
    summarize,
)
from ksana_llm.bench.stream import (
    NulChunkDecoder,
    SSEDecoder,
    ksana_chunk_state,
    openai_chunk_text,
)


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

def test_unreported_token_counts_stay_unknown():
    row = summarize([result(0, 0.0, [0.1], 1.0, None, 2)], 1.0, request_rate=1.0, concurrency=1,
                    percentiles=(50,), stream=True)
    assert math.isnan(row["Avg input tokens"]) and row["Avg output tokens"] == 2


def test_decode_token_throughput():
    results = [result(0, 0.0, [], 1.0, 10, 5), result(1, 0.0, [], 1.0, 10, 1)]
    plain = summarize(results, 2.0, request_rate=1.0, concurrency=1, percentiles=(50,),
                      stream=False)
    decode = summarize(results, 2.0, request_rate=1.0, concurrency=1, percentiles=(50,),
                       stream=False, decode_token_throughput=True)
    assert plain["Token throughput"] == 26 / 2.0 and plain["Decode token throughput"] == 4 / 2.0
    assert decode["Token throughput"] == 4 / 2.0
