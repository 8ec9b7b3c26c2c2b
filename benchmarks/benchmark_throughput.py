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

The parsing and statistics are pure functions (`SSEDecoder`, `NulChunkDecoder`, `summarize`,
`percentile`, `arrival_offsets`, ...) so they are unit-tested without a server.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

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


# ---- per-request record ------------------------------------------------------------------------

@dataclass
class RequestResult:
    """What one request did. Times are `time.perf_counter()` seconds."""

    index: int
    prompt: str
    start: float = 0.0
    end: float = 0.0
    output: str = ""
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks with new tokens
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# ---- stream decoders (pure) --------------------------------------------------------------------

class SSEDecoder:
    """Incremental Server-Sent-Events decoder: bytes in, complete event `data` payloads out.

    Network reads split events anywhere, so partial lines are buffered. Multi-line `data:` fields
    of one event are joined with a newline, as the SSE spec says; comments and other fields are
    ignored.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return events
            line = self._buffer[:newline].rstrip(b"\r").decode("utf-8")
            self._buffer = self._buffer[newline + 1:]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))

    def flush(self) -> list[str]:
        """Events left when the stream closed without a final blank line."""
        events = self.feed(b"\n\n") if (self._buffer or self._data) else []
        self._buffer = b""
        return events


class NulChunkDecoder:
    """KsanaLLM's native stream: JSON objects each followed by a NUL byte."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        self._buffer += chunk
        *complete, self._buffer = self._buffer.split(b"\0")
        return [json.loads(piece) for piece in complete if piece.strip()]

    def flush(self) -> list[dict[str, Any]]:
        rest, self._buffer = self._buffer, b""
        return [json.loads(rest)] if rest.strip() else []


def openai_chunk_text(event: dict[str, Any]) -> str:
    """Text carried by one OpenAI stream chunk (completions `text` or chat `delta.content`)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def first_sequence(value: Any) -> Any:
    """KsanaLLM returns one entry per sequence (`texts`, `output_token_ids`): take the first."""
    if isinstance(value, list) and value and isinstance(value[0], (list, str)):
        return value[0]
    return value


def ksana_chunk_state(chunk: dict[str, Any]) -> tuple[str, int, int | None]:
    """(text so far, output tokens so far, input tokens or None) of a cumulative /generate chunk."""
    text = first_sequence(chunk.get("texts") or [""])
    tokens = first_sequence(chunk.get("output_token_ids") or [])
    inputs = chunk.get("input_token_ids")
    return (text if isinstance(text, str) else "", len(tokens) if isinstance(tokens, list) else 0,
            len(inputs) if isinstance(inputs, list) else None)


# ---- statistics (pure) -------------------------------------------------------------------------

def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _fmt_p(p: float) -> str:
    return f"{p:g}"


def _spread(name: str, values: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    row = {f"Avg {name}": mean(values), f"Median {name}": percentile(values, 50)}
    row.update({f"P{_fmt_p(p)} {name}": percentile(values, p) for p in percentiles})
    return row


def summarize(results: Sequence[RequestResult], duration: float, *, request_rate: float,
              concurrency: int | None, percentiles: Sequence[float], stream: bool
              ) -> dict[str, float]:
    """The perf row: KsanaLLM's columns first (same names), then our additions.

    Failed requests are counted but left out of every other figure. Token throughputs use the
    whole run's wall time, so they are what a user of the server would see.
    """
    ok = [r for r in results if r.ok]
    # A count the server did not report stays unknown (NaN average), rather than reading as 0.
    known_in = [r.input_tokens for r in ok if r.input_tokens is not None]
    known_out = [r.output_tokens for r in ok if r.output_tokens is not None]
    in_tokens, out_tokens = sum(known_in), sum(known_out)
    latencies = [r.latency for r in ok]
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    row: dict[str, float] = {
        "Request rate": request_rate,
        "Concurrency": float(concurrency) if concurrency else math.inf,
        "Total latency": duration,
        "Request throughput": per_second(len(ok)),
        "Avg latency": mean(latencies),
        "Avg input chars": mean([len(r.prompt) for r in ok]),
        "Avg output chars": mean([len(r.output) for r in ok]),
        "Avg input tokens": mean(known_in),
        "Avg output tokens": mean(known_out),
        "Token throughput": per_second(in_tokens + out_tokens),
    }
    row.update({f"P{_fmt_p(p)} latency": percentile(latencies, p) for p in percentiles})
    if stream:
        row.update(_spread("TTFT", [r.ttft for r in ok if r.ttft is not None], percentiles))
        row.update(_spread("ITL", [gap for r in ok for gap in r.itls], percentiles))
        row.update(_spread("TPOT", [r.tpot for r in ok if r.tpot is not None], percentiles))
    row.update({
        "Input token throughput": per_second(in_tokens),
        "Output token throughput": per_second(out_tokens),
        "Median latency": percentile(latencies, 50),
        "Successful requests": float(len(ok)),
        "Failed requests": float(len(results) - len(ok)),
    })
    return row


def arrival_offsets(n: int, rate: float, rng: random.Random) -> list[float]:
    """Start times (seconds from t0) of n requests: a Poisson process of `rate` req/s, or all at
    0 when the rate is infinite. Exponential gaps are what a Poisson process has."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


# ---- input and output files --------------------------------------------------------------------

def read_prompts(path: str | Path, col_idx: int = 0, prompt_num: int = 0) -> list[str]:
    """Prompts from column `col_idx` of a CSV with a header row. `prompt_num` 0 = all; more than
    the file holds cycles through it, so a small file can drive a long run."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))[1:]
    prompts = []
    for line, row in enumerate(rows, start=2):
        if col_idx >= len(row):
            raise ValueError(f"{path}:{line}: no column {col_idx} (the row has {len(row)})")
        if row[col_idx].strip():
            prompts.append(row[col_idx])
    if not prompts:
        raise ValueError(f"{path}: no prompts in column {col_idx}")
    if prompt_num > 0:
        prompts = [prompts[i % len(prompts)] for i in range(prompt_num)]
    return prompts


OUTPUT_COLUMNS = ("index", "output", "prompt", "input_tokens", "output_tokens", "latency_s",
                  "ttft_s", "error")


def write_output_csv(path: str | Path, results: Sequence[RequestResult]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(OUTPUT_COLUMNS)
        for r in sorted(results, key=lambda r: r.index):
            writer.writerow([r.index, r.output, r.prompt, r.input_tokens, r.output_tokens,
                             f"{r.latency:.5f}", "" if r.ttft is None else f"{r.ttft:.5f}",
                             r.error or ""])


def write_perf_csv(path: str | Path, row: dict[str, float]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(row.keys())
        writer.writerow([f"{v:.5f}" for v in row.values()])


def format_summary(row: dict[str, float]) -> str:
    width = max(len(k) for k in row)
    return "\n".join(f"{k:<{width}} : {v:.5f}" for k, v in row.items())


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

    try:  # run as `python benchmarks/benchmark_throughput.py`: its folder is on sys.path
        from offline_throughput import allowed_token_ids, build_workload
    except ImportError:  # imported as benchmarks.benchmark_throughput
        from benchmarks.offline_throughput import allowed_token_ids, build_workload

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
