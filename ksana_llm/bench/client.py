"""Load client for a running server, with KsanaLLM's `benchmark_throughput.py` flags.

    ksana-llm bench --port 8080 --input_csv prompts.csv --backend ksana --stream \\
        --request_rate 4 --prompt_num 64 --max_new_tokens 128 --percentiles 50 90 99 \\
        --perf_csv perf.csv --output_csv out.csv

(`python benchmarks/benchmark_throughput.py ...` in a source checkout is the same program.)

Backends: `ksana` (the default, as in KsanaLLM) posts to the native /generate, with KsanaLLM's
`sampling_config` keys (NUL-delimited cumulative JSON chunks when streaming); `openai` and `vllm`
post to /v1/completions with the OpenAI/vLLM names (SSE when streaming, token counts from `usage`).
`openai` is this server's OpenAI API, which also takes `num_beams` and `no_repeat_ngram_size`;
`vllm` sends only what vLLM understands and refuses the rest. `--model_type` is sent to /generate,
whose server wraps the prompt in that family's chat affix; on /v1/completions the client wraps the
text prompts itself (as KsanaLLM's client does for vLLM).

Load shape (as KsanaLLM's client):
- `--mode async` (default, open loop): requests start at their arrival times whatever is in
  flight: `--concurrency` requests at a time (default 1), at `--request_rate` requests/s on
  average (`inf` = all at once), evenly spaced, or a Poisson process with `--random` (seeded by
  `--seed`). `--max_concurrency`, our addition, caps the requests in flight.
- `--mode sync` (closed loop): `--concurrency` workers each send their next request when the
  previous one returns, none before its arrival time.
- `--warmup_num_iters N` runs the whole workload N times unmeasured first; `--repeat_num_iters N`
  measures N runs of it together. `--request_rate_num_iters N` runs N request rates, each
  `--request_rate_step` above the last; with `--max_avg_latency` / `--max_first_token_latency` it
  then searches the highest rate whose averages stay within those bounds (one perf row per rate).

Reported (and written to `--perf_csv`, KsanaLLM's column names first, values `%.5f`): request,
input, output, decode and total token throughput; latency; and with `--stream` TTFT, ITL (every
gap between chunks carrying new tokens, over all requests) and TPOT = (latency - TTFT) / (output
tokens - 1), each as mean, median and the `--percentiles`. `--output_csv` writes one row per
request of the last run. A request fails (counted, left out of the figures) on an HTTP error, a
broken stream, or an `error` object in the answer or in a stream chunk. `--enable_diff_check`
compares the answers of each later run with the first run's (`ksana_llm.bench.diff_check`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from ksana_llm.bench import diff_check
from ksana_llm.bench.results import (RequestResult, arrival_offsets, format_summary,
                                     next_request_rate, summarize, write_output_csv,
                                     write_perf_csv)
from ksana_llm.bench.stream import (NulChunkDecoder, SSEDecoder, error_message, ksana_chunk_state,
                                    openai_chunk_has_tokens, openai_chunk_text)
from ksana_llm.bench.flags import (DONE, OPENAI_BACKENDS, BenchConfig, build_parser,
                                   config_from_args, load_prompts)
from ksana_llm.bench.request_bodies import build_request

log = logging.getLogger(__name__)

def _headers(cfg: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


class ServerError(Exception):
    """An `error` object in a 200 answer or in a stream chunk: the request failed."""


async def _read_openai_stream(response: httpx.Response, result: RequestResult) -> None:
    decoder, done = SSEDecoder(), False
    try:
        async for raw in response.aiter_bytes():
            now = time.perf_counter()
            for data in decoder.feed(raw):
                done = _apply_openai_event(data, result, now) or done
        for data in decoder.flush():
            done = _apply_openai_event(data, result, time.perf_counter()) or done
    except ServerError as exc:
        result.error = str(exc)
        return
    if not done:  # cut off (or never an answer): not a finished request
        result.error = f"the stream ended without {DONE}"
        return
    if result.output_tokens is None:  # no usage chunk: one token per chunk is the best guess
        result.output_tokens = len(result.chunk_times)


def _apply_openai_event(data: str, result: RequestResult, now: float) -> bool:
    """One SSE payload: chunks with a choice count as token arrivals (their text may be empty:
    EOS alone); the usage chunk gives the counts. True for the stream's closing [DONE]."""
    if data.strip() == DONE:
        return True
    event = json.loads(data)
    message = error_message(event)
    if message is not None:
        raise ServerError(f"server error in stream: {message}")
    if openai_chunk_has_tokens(event):
        result.output += openai_chunk_text(event)
        result.chunk_times.append(now)
    usage = event.get("usage")
    if usage:
        result.input_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens")
    return False


async def _read_ksana_stream(response: httpx.Response, result: RequestResult) -> None:
    decoder, seen, chunks = NulChunkDecoder(), 0, 0
    try:
        async for raw in response.aiter_bytes():
            now = time.perf_counter()
            for chunk in decoder.feed(raw):
                seen, chunks = _apply_ksana_chunk(chunk, result, seen, now), chunks + 1
        for chunk in decoder.flush():
            seen, chunks = _apply_ksana_chunk(chunk, result, seen, time.perf_counter()), chunks + 1
    except ServerError as exc:  # the rest of the stream is not read: the request failed
        result.error = str(exc)
    if not chunks and result.error is None:  # /generate's stream always ends with its result
        result.error = "the stream ended without a result"
    result.output_tokens = seen


def _apply_ksana_chunk(chunk: dict[str, Any], result: RequestResult, seen: int, now: float) -> int:
    """Chunks are cumulative: a chunk counts as a token arrival only if the count grew. A chunk
    carrying `error` (the server failed after its 200 went out) fails the request."""
    message = error_message(chunk)
    if message is not None:
        raise ServerError(f"server error in stream: {message}")
    text, num_tokens, num_inputs = ksana_chunk_state(chunk)
    if num_tokens > seen:
        result.chunk_times.append(now)
    result.output = text
    if num_inputs is not None:
        result.input_tokens = num_inputs
    return max(seen, num_tokens)


def _apply_full_response(cfg: BenchConfig, body: Any, result: RequestResult) -> None:
    message = error_message(body)
    if message is not None:
        raise ServerError(f"server error: {message}")
    if not isinstance(body, dict):
        raise ServerError(f"the answer is not a JSON object: {str(body)[:300]}")
    if cfg.backend in OPENAI_BACKENDS:
        result.output = openai_chunk_text(body)
        usage = body.get("usage") or {}
        result.input_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens")
    else:
        result.output, result.output_tokens, result.input_tokens = ksana_chunk_state(body)


async def send_one(client: httpx.AsyncClient, cfg: BenchConfig, index: int,
                   prompt: str | list[int]) -> RequestResult:
    """Send one request and time it; a failure is recorded in the result, never raised."""
    path, body = build_request(cfg, prompt,
                               cfg.output_lens[index] if cfg.output_lens is not None else None)
    is_text = isinstance(prompt, str)
    result = RequestResult(index, prompt if is_text else f"<{len(prompt)} token ids>",
                           prompt_is_text=is_text, start=time.perf_counter())
    try:
        async with client.stream("POST", path, json=body, headers=_headers(cfg)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
            elif cfg.stream and cfg.backend in OPENAI_BACKENDS:
                await _read_openai_stream(response, result)
            elif cfg.stream:
                await _read_ksana_stream(response, result)
            else:
                _apply_full_response(cfg, json.loads(await response.aread()), result)
    except ServerError as exc:
        result.error = str(exc)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    return result


# ---- load loops --------------------------------------------------------------------------------

async def _run_open_loop(client: httpx.AsyncClient, cfg: BenchConfig,
                         prompts: Sequence[str | list[int]], offsets: Sequence[float]
                         ) -> list[RequestResult]:
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    t0 = time.perf_counter()

    async def launch(index: int) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + offsets[index] - time.perf_counter()))
        if limit is None:
            return await send_one(client, cfg, index, prompts[index])
        async with limit:
            return await send_one(client, cfg, index, prompts[index])

    return list(await asyncio.gather(*(launch(i) for i in range(len(prompts)))))


async def _run_closed_loop(client: httpx.AsyncClient, cfg: BenchConfig,
                           prompts: Sequence[str | list[int]], offsets: Sequence[float]
                           ) -> list[RequestResult]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    workers = min(cfg.concurrency, cfg.max_concurrency or cfg.concurrency)
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            await asyncio.sleep(max(0.0, t0 + offsets[index] - time.perf_counter()))
            results.append(await send_one(client, cfg, index, prompts[index]))

    await asyncio.gather(*(worker() for _ in range(workers)))
    return results


async def run_pass(client: httpx.AsyncClient, cfg: BenchConfig,
                   prompts: Sequence[str | list[int]]) -> list[RequestResult]:
    """Every prompt once, at the configured arrival times."""
    offsets = arrival_offsets(len(prompts), cfg.request_rate, random.Random(cfg.seed),
                              burst=cfg.concurrency, poisson=cfg.poisson)
    if cfg.mode == "sync":
        return await _run_closed_loop(client, cfg, prompts, offsets)
    return await _run_open_loop(client, cfg, prompts, offsets)


async def resolve_model(client: httpx.AsyncClient, cfg: BenchConfig) -> str | None:
    """The served model name: --model, else the first id of /v1/models (None if unavailable)."""
    if cfg.model or cfg.backend not in OPENAI_BACKENDS:
        return cfg.model
    try:
        response = await client.get("/v1/models", headers=_headers(cfg))
        data = response.json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


async def run_benchmark(cfg: BenchConfig, prompts: Sequence[str | list[int]],
                        transport: httpx.AsyncBaseTransport | None = None
                        ) -> tuple[BenchConfig, list[RequestResult], float]:
    """`cfg.warmup_num_iters` unmeasured passes over the prompts, then `cfg.repeat_num_iters`
    measured ones; returns the config actually used, the measured results (pooled, pass after
    pass) and the measured wall time.

    `transport` lets tests drive an in-process ASGI app instead of a socket.
    """
    timeout = httpx.Timeout(cfg.client_timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=timeout, limits=limits,
                                 transport=transport) as client:
        model = await resolve_model(client, cfg)
        if model != cfg.model:
            cfg = dataclasses.replace(cfg, model=model)
        for i in range(cfg.warmup_num_iters):
            warm = await run_pass(client, cfg, prompts)
            ok = sum(r.ok for r in warm)
            print(f"warm-up pass {i + 1}/{cfg.warmup_num_iters} at {cfg.request_rate:g} req/s: "
                  f"{ok}/{len(warm)} requests succeeded", file=sys.stderr)
        results: list[RequestResult] = []
        duration = 0.0
        for _ in range(cfg.repeat_num_iters):
            if cfg.clear_cache:
                await clear_prefix_cache(client, cfg)  # (not timed)
            t0 = time.perf_counter()
            results += await run_pass(client, cfg, prompts)
            duration += time.perf_counter() - t0
    return cfg, results, duration


async def clear_prefix_cache(client: httpx.AsyncClient, cfg: BenchConfig) -> None:
    """--clear_cache: POST /reset_prefix_cache (this server's route, and vLLM's in its dev
    mode); KsanaLLM's client sends a special request to a server built to flush on it instead.
    A server that cannot flush gets a warning, and the run goes on."""
    try:
        response = await client.post("/reset_prefix_cache", headers=_headers(cfg))
    except httpx.HTTPError as exc:
        log.warning("--clear_cache: POST /reset_prefix_cache failed (%r); the prefix cache "
                    "stays", exc)
        return
    if response.status_code != 200:
        log.warning("--clear_cache: the server answered %d to POST /reset_prefix_cache; the "
                    "prefix cache stays", response.status_code)
        return
    try:
        dropped = response.json().get("num_blocks_dropped")
    except (ValueError, AttributeError):
        dropped = None  # vLLM answers with an empty body
    print("--clear_cache: prefix cache emptied" +
          ("" if dropped is None else f" ({dropped} blocks dropped)"), file=sys.stderr)


def _diff_check(args: argparse.Namespace, results: Sequence[RequestResult], per_pass: int,
                title: str) -> str:
    """Each later pass's answers against the first pass's, request by request (pairs with a
    failed request are left out); prints the summary, returns the detailed report."""
    passes = [sorted(results[k:k + per_pass], key=lambda r: r.index)
              for k in range(0, len(results), per_pass)]
    sections = []
    for number, later in enumerate(passes[1:], start=2):
        pairs = [(a, b) for a, b in zip(passes[0], later) if a.ok and b.ok]
        diffs = diff_check.compare([a.output for a, _ in pairs], [b.output for _, b in pairs],
                                   [a.index for a, _ in pairs])
        print(f"diff check, run 1 vs run {number}: " + diff_check.summary(
            diffs, args.diff_rouge_threshold, args.diff_mismatch_threshold), flush=True)
        sections.append(diff_check.report(diffs, args.diff_rouge_threshold,
                                          args.diff_mismatch_threshold,
                                          f"{title}: run 1 vs run {number}"))
    return "\n".join(sections)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        prompts, cfg = load_prompts(args, cfg)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    history: list[tuple[float, float, float]] = []
    rows: list[dict[str, float]] = []
    results: list[RequestResult] = []
    reports: list[str] = []
    ok_total = measured_total = 0
    while True:
        rate = next_request_rate(history, start=cfg.request_rate, step=cfg.request_rate_step,
                                 num_iters=cfg.request_rate_num_iters,
                                 max_avg_latency=cfg.max_avg_latency,
                                 max_first_token_latency=cfg.max_first_token_latency,
                                 max_rate=float(len(prompts)))
        if rate is None:
            break
        used, results, duration = asyncio.run(
            run_benchmark(dataclasses.replace(cfg, request_rate=rate), prompts))
        row = summarize(results, duration, request_rate=rate, concurrency=used.concurrency,
                        percentiles=used.percentiles, stream=used.stream,
                        passes=used.repeat_num_iters,
                        decode_token_throughput=used.show_decode_token_throughput)
        if rows:
            print()
        print(format_summary(row), flush=True)
        failures = [r for r in results if not r.ok]
        for r in failures[:5]:
            print(f"request {r.index} failed: {r.error}", file=sys.stderr)
        rows.append(row)
        history.append((rate, row["Avg latency"], row.get("Avg TTFT", 0.0)))
        ok_total += len(results) - len(failures)
        measured_total += len(results)
        if args.enable_diff_check:
            reports.append(_diff_check(args, results, len(prompts), f"request rate {rate:g}"))
    if args.output_csv:
        write_output_csv(args.output_csv, results[-len(prompts):])
    if reports:
        Path(args.diff_output_file).write_text("\n".join(reports), encoding="utf-8")
        print(f"diff report: {args.diff_output_file}")
    if args.perf_csv:
        write_perf_csv(args.perf_csv, rows)
    return 1 if measured_total and not ok_total else 0


if __name__ == "__main__":
    sys.exit(main())
