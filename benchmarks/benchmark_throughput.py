"""Load client for a running ksana-llm server, with KsanaLLM's `benchmark_throughput.py` flags.

    python benchmarks/benchmark_throughput.py --port 8080 --input_csv benchmarks/sample_prompts.csv \\
        --backend openai --stream --request_rate 4 --prompt_num 64 --max_new_tokens 128 \\
        --percentiles 50,90,99 --perf_csv perf.csv --output_csv out.csv

Backends: `openai` posts to /v1/completions (SSE when streaming, token counts from `usage`);
`ksana` posts to the native /generate (NUL-delimited cumulative JSON chunks when streaming).

Load shape:
- `--mode async` (default, open loop): request i starts at its arrival time, drawn from a Poisson
  process of `--request_rate` req/s (`inf` = all at once, seeded by `--seed`); `--concurrency`, if
  given, caps the requests in flight.
- `--mode sync` (closed loop): `--concurrency` workers (default 1) each send their next request as
  soon as the previous one returns; `--request_rate` is ignored.

Reported (and written to `--perf_csv`, KsanaLLM's column names first, values `%.5f`): request,
input, output and total token throughput; latency; and with `--stream` TTFT, ITL (every gap between
chunks carrying new tokens, over all requests) and TPOT = (latency - TTFT) / (output tokens - 1),
each as mean, median and the `--percentiles`. `--output_csv` writes one row per request.

The parsing (`benchmarks/stream_decoding.py`) and the statistics and files
(`benchmarks/client_results.py`) are pure functions, unit-tested without a server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.client_results import (RequestResult, arrival_offsets,  # noqa: E402
                                       format_summary, read_prompts, summarize,
                                       write_output_csv, write_perf_csv)
from benchmarks.stream_decoding import (NulChunkDecoder, SSEDecoder,  # noqa: E402
                                        ksana_chunk_state, openai_chunk_text)

DONE = "[DONE]"


# ---- configuration -----------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchConfig:
    """Everything one run needs, built from the command line (see `parse_args`)."""

    host: str = "localhost"
    port: int = 8080
    backend: str = "openai"  # "openai" | "ksana"
    mode: str = "async"  # "async" | "sync"
    stream: bool = False
    request_rate: float = math.inf
    concurrency: int | None = None
    max_new_tokens: int = 1024
    temperature: float = 0.0
    ignore_eos: bool = False
    model: str | None = None
    api_key: str | None = None
    percentiles: tuple[float, ...] = (99.0,)
    seed: int = 0
    client_timeout: float = 3 * 3600.0
    # Per-request output lengths (the offline benchmark's workload); None: max_new_tokens for all.
    output_lens: tuple[int, ...] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


# ---- requests ----------------------------------------------------------------------------------

def build_request(cfg: BenchConfig, prompt: str | list[int], max_new_tokens: int | None = None
                  ) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one request for the configured backend; a prompt is text or token
    ids (sent as `input_tokens` to /generate)."""
    max_new_tokens = max_new_tokens or cfg.max_new_tokens
    if cfg.backend == "openai":
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_new_tokens,
                                "temperature": cfg.temperature, "stream": cfg.stream}
        if cfg.model:
            body["model"] = cfg.model
        if cfg.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extra parameter
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}
        return "/v1/completions", body
    sampling = {"max_new_tokens": max_new_tokens, "temperature": cfg.temperature,
                "ignore_eos": cfg.ignore_eos}
    key = "prompt" if isinstance(prompt, str) else "input_tokens"
    return "/generate", {key: prompt, "sampling_config": sampling, "stream": cfg.stream}


def _headers(cfg: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def _read_openai_stream(response: httpx.Response, result: RequestResult) -> None:
    decoder = SSEDecoder()
    async for raw in response.aiter_bytes():
        now = time.perf_counter()
        for data in decoder.feed(raw):
            _apply_openai_event(data, result, now)
    for data in decoder.flush():
        _apply_openai_event(data, result, time.perf_counter())
    if result.output_tokens is None:  # no usage chunk: one token per chunk is the best guess
        result.output_tokens = len(result.chunk_times)


def _apply_openai_event(data: str, result: RequestResult, now: float) -> None:
    """One SSE payload: text chunks count as token arrivals; the usage chunk gives the counts."""
    if data.strip() == DONE:
        return
    event = json.loads(data)
    if "error" in event:
        raise ValueError(f"server error in stream: {event['error']}")
    text = openai_chunk_text(event)
    if text:
        result.output += text
        result.chunk_times.append(now)
    usage = event.get("usage")
    if usage:
        result.input_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens")


async def _read_ksana_stream(response: httpx.Response, result: RequestResult) -> None:
    decoder, seen = NulChunkDecoder(), 0
    async for raw in response.aiter_bytes():
        now = time.perf_counter()
        for chunk in decoder.feed(raw):
            seen = _apply_ksana_chunk(chunk, result, seen, now)
    for chunk in decoder.flush():
        seen = _apply_ksana_chunk(chunk, result, seen, time.perf_counter())
    result.output_tokens = seen


def _apply_ksana_chunk(chunk: dict[str, Any], result: RequestResult, seen: int, now: float) -> int:
    """Chunks are cumulative: a chunk counts as a token arrival only if the count grew."""
    text, num_tokens, num_inputs = ksana_chunk_state(chunk)
    if num_tokens > seen:
        result.chunk_times.append(now)
    result.output = text
    if num_inputs is not None:
        result.input_tokens = num_inputs
    return max(seen, num_tokens)


def _apply_full_response(cfg: BenchConfig, body: dict[str, Any], result: RequestResult) -> None:
    if cfg.backend == "openai":
        result.output = openai_chunk_text(body)
        usage = body.get("usage") or {}
        result.input_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens")
    else:
        result.output, result.output_tokens, result.input_tokens = ksana_chunk_state(body)


async def send_one(client: httpx.AsyncClient, cfg: BenchConfig, index: int, prompt: str
                   ) -> RequestResult:
    """Send one request and time it; a failure is recorded in the result, never raised."""
    path, body = build_request(cfg, prompt,
                               cfg.output_lens[index] if cfg.output_lens is not None else None)
    result = RequestResult(index, prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>",
                           start=time.perf_counter())
    try:
        async with client.stream("POST", path, json=body, headers=_headers(cfg)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
            elif cfg.stream and cfg.backend == "openai":
                await _read_openai_stream(response, result)
            elif cfg.stream:
                await _read_ksana_stream(response, result)
            else:
                _apply_full_response(cfg, json.loads(await response.aread()), result)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    return result


async def _run_open_loop(client: httpx.AsyncClient, cfg: BenchConfig, prompts: Sequence[str]
                         ) -> list[RequestResult]:
    offsets = arrival_offsets(len(prompts), cfg.request_rate, random.Random(cfg.seed))
    limit = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    t0 = time.perf_counter()

    async def launch(index: int) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + offsets[index] - time.perf_counter()))
        if limit is None:
            return await send_one(client, cfg, index, prompts[index])
        async with limit:
            return await send_one(client, cfg, index, prompts[index])

    return list(await asyncio.gather(*(launch(i) for i in range(len(prompts)))))


async def _run_closed_loop(client: httpx.AsyncClient, cfg: BenchConfig, prompts: Sequence[str]
                           ) -> list[RequestResult]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[RequestResult] = []

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            results.append(await send_one(client, cfg, index, prompts[index]))

    await asyncio.gather(*(worker() for _ in range(cfg.concurrency or 1)))
    return results


async def resolve_model(client: httpx.AsyncClient, cfg: BenchConfig) -> str | None:
    """The served model name: --model, else the first id of /v1/models (None if unavailable)."""
    if cfg.model or cfg.backend != "openai":
        return cfg.model
    try:
        response = await client.get("/v1/models", headers=_headers(cfg))
        data = response.json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def run_benchmark(cfg: BenchConfig, prompts: Sequence[str],
                        transport: httpx.AsyncBaseTransport | None = None
                        ) -> tuple[BenchConfig, list[RequestResult], float]:
    """Run every prompt once; returns the config actually used, the results and the wall time.

    `transport` lets tests drive an in-process ASGI app instead of a socket.
    """
    timeout = httpx.Timeout(cfg.client_timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=timeout, limits=limits,
                                 transport=transport) as client:
        model = await resolve_model(client, cfg)
        if model != cfg.model:
            cfg = BenchConfig(**{**cfg.__dict__, "model": model})
        t0 = time.perf_counter()
        if cfg.mode == "sync":
            results = await _run_closed_loop(client, cfg, prompts)
        else:
            results = await _run_open_loop(client, cfg, prompts)
        duration = time.perf_counter() - t0
    return cfg, results, duration


# ---- command line ------------------------------------------------------------------------------

def _percentile_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 <= p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {text!r}")
    return values


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--input_csv", "--dataset_path", dest="input_csv",
                   default=str(Path(__file__).with_name("sample_prompts.csv")),
                   help="CSV with a header row; prompts in column --col_idx")
    p.add_argument("--col_idx", type=int, default=0)
    p.add_argument("--prompt_num", type=int, default=0, help="0 = every prompt once; more cycles")
    p.add_argument("--request_rate", type=_rate, default=math.inf,
                   help="req/s of Poisson arrivals (async mode); inf = all at once")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--concurrency", type=int, default=None,
                   help="async: max requests in flight (default: no cap); sync: workers (default 1)")
    p.add_argument("--mode", choices=("async", "sync"), default="async")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--backend", choices=("ksana", "openai"), default="openai")
    p.add_argument("--model", default=None,
                   help="served model name (openai); default: the first of /v1/models")
    p.add_argument("--api-key", "--api_key", dest="api_key", default=None)
    p.add_argument("--max_new_tokens", type=int, default=1024)
    p.add_argument("--random_workload", type=int, default=0, metavar="N",
                   help="instead of --input_csv: the offline benchmark's workload of N requests "
                        "(random non-special token ids, input and output lengths uniform in "
                        "[--random_min_len, --random_max_len], --seed), EOS ignored")
    p.add_argument("--random_min_len", type=int, default=32)
    p.add_argument("--random_max_len", type=int, default=256)
    p.add_argument("--tokenizer", default=None,
                   help="model folder whose tokenizer defines the special ids to avoid "
                        "(default: the embedded default model)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore_eos", action="store_true")
    p.add_argument("--percentiles", type=_percentile_list, default=(99.0,),
                   help="comma-separated, e.g. 50,90,99")
    p.add_argument("--client_timeout", type=float, default=3 * 3600.0, help="seconds per request")
    p.add_argument("--output_csv", default=None, help="per-request outputs")
    p.add_argument("--perf_csv", default=None, help="the summary row")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.concurrency is not None and args.concurrency < 0:
        raise ValueError(f"--concurrency must be >= 0, got {args.concurrency}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    return BenchConfig(host=args.host, port=args.port, backend=args.backend, mode=args.mode,
                       stream=args.stream, request_rate=args.request_rate,
                       concurrency=args.concurrency, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, ignore_eos=args.ignore_eos, model=args.model,
                       api_key=args.api_key, percentiles=args.percentiles, seed=args.seed,
                       client_timeout=args.client_timeout)


def random_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """The exact requests `benchmarks/offline_throughput.py` sends, so server and offline
    throughput can be compared on one workload."""
    from transformers import AutoTokenizer

    from ksana_llm.loader import resolve_model_dir

    from benchmarks.workload import allowed_token_ids, build_workload

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.tokenizer))
    allowed = allowed_token_ids(tokenizer, len(tokenizer))
    workload = build_workload(args.random_workload, args.random_min_len, args.random_max_len,
                              args.seed, allowed)
    return workload.prompts, workload.output_lens


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        if args.random_workload:
            prompts, output_lens = random_workload(args)
            cfg = BenchConfig(**{**cfg.__dict__, "output_lens": tuple(output_lens),
                                 "ignore_eos": True})
        else:
            prompts = read_prompts(args.input_csv, args.col_idx, args.prompt_num)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    cfg, results, duration = asyncio.run(run_benchmark(cfg, prompts))
    concurrency = (cfg.concurrency or 1) if cfg.mode == "sync" else cfg.concurrency
    row = summarize(results, duration, request_rate=cfg.request_rate,
                    concurrency=concurrency, percentiles=cfg.percentiles, stream=cfg.stream)
    print(format_summary(row))
    failures = [r for r in results if not r.ok]
    for r in failures[:5]:
        print(f"request {r.index} failed: {r.error}", file=sys.stderr)
    if args.output_csv:
        write_output_csv(args.output_csv, results)
    if args.perf_csv:
        write_perf_csv(args.perf_csv, row)
    return 1 if failures and len(failures) == len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
