"""Prometheus metrics of the server, named like vLLM's (`ksana_llm:` instead of `vllm:`; the
prefix is a setting, `serve --metrics-prefix vllm`, for dashboards and autoscalers built on vLLM's
names).

Why the shape: each `ServerMetrics` owns its own `CollectorRegistry`, so two apps (or two tests) in
one process never share or double-register series. Engine state (queue lengths, KV usage, prefix
hits, preemptions) is read from `engine.stats()` at scrape time by a custom collector, so it is
never stale and nothing has to poll. Per-request series (tokens, latencies, finish reasons) are fed
by the server when a request ends, from the `RequestOutput` the engine returned.

Server usage:

    metrics = ServerMetrics(model_name="SmolLM2")
    mount(app, engine, metrics)                   # GET /metrics
    timer = metrics.token_timer()                 # per streaming request
    ...  timer.tick()                             # on every streamed chunk with new tokens
    metrics.observe_finished(output, queue_time)  # once per request the engine returned
    metrics.count_failure("queue_full")           # once per request refused or failed

What counts where (each HTTP request once, by how it ended):
- Finished engine requests -> `request_success_total{finished_reason}`, tokens and latencies.
  A client that goes away is no failure: its requests end with finished_reason "abort" and are
  counted there, streamed or not (vLLM's rule). `prompt_tokens_total` counts the prompts the
  engine scheduled (vLLM counts prefilled prompts): an abort before that adds none.
- Refused or failed requests -> `request_failure_total{reason}` only, once per HTTP request:
  "invalid_request" (400, 404, 413), "unauthorized" (401), "queue_full" (429), "timeout" (never
  scheduled within --waiting-timeout-ms), "engine_error" (503), "other" (500). The engine
  requests a refused request had already queued are aborted and never reach the success series.
  A failure after a stream started (its error event) is counted when the stream ends.
- Forward-only requests (/forward, /v1/embeddings, /score, /rerank, /classify): each engine
  request that finishes counts as vLLM counts a pooling request, in
  `request_success_total{finished_reason="stop"}`, `prompt_tokens_total` and
  `request_prompt_tokens`; an HTTP request whose client went away is counted once as
  request_failure_total{reason="aborted"} (the only use of that reason).

Series (all carry the label `model_name`):
- gauges `ksana_llm:num_requests_running|waiting|swapped`, `ksana_llm:kv_cache_usage_perc`
  (0..1), `ksana_llm:prefix_cache_hit_rate` (0..1), `ksana_llm:num_kv_blocks`,
  `ksana_llm:num_free_kv_blocks`, `ksana_llm:avg_generation_throughput_toks_per_s`, and with
  LoRA slots vLLM's info gauge `ksana_llm:lora_requests_info{max_lora, running_lora_adapters,
  waiting_lora_adapters}` (comma-separated adapter names; the value is the scrape time)
- counters `ksana_llm:num_preemptions_total`, `ksana_llm:prefix_cache_queries_total`,
  `ksana_llm:prefix_cache_hits_total` (prompt tokens), `ksana_llm:spec_decode_num_draft_tokens_total`,
  `ksana_llm:spec_decode_num_accepted_tokens_total`, `ksana_llm:spec_decode_num_drafts_total`,
  `ksana_llm:spec_decode_num_accepted_tokens_per_pos_total{position}` (once drafts ran),
  `ksana_llm:kv_transfer_imported_tokens_total`, `ksana_llm:kv_transfer_exported_tokens_total`
  (from the engine),
  `ksana_llm:prompt_tokens_total`,
  `ksana_llm:generation_tokens_total`, `ksana_llm:request_success_total{finished_reason}`,
  `ksana_llm:request_failure_total{reason}`
- histograms (seconds) `ksana_llm:time_to_first_token_seconds`,
  `ksana_llm:inter_token_latency_seconds` (streamed chunks), `ksana_llm:e2e_request_latency_seconds`,
  `ksana_llm:request_queue_time_seconds`, `ksana_llm:request_time_per_output_token_seconds`,
  `ksana_llm:request_prefill_time_seconds` (first scheduled -> first token),
  `ksana_llm:request_decode_time_seconds` (first token -> last),
  `ksana_llm:request_inference_time_seconds` (first scheduled -> last token)
- histograms (tokens; 1-2-5 buckets up to the model length) `ksana_llm:request_prompt_tokens`,
  `ksana_llm:request_generation_tokens`, `ksana_llm:request_max_num_generation_tokens`,
  `ksana_llm:request_params_max_tokens`, and `ksana_llm:request_params_n` (1, 2, 5, 10, 20): per
  finished request, the token ones only for requests that were scheduled, the params ones when
  the server gave the request's config; `ksana_llm:iteration_tokens_total`, the tokens each engine
  step computed (from the engine, at scrape time)
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                   HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ksana_llm.api.engine import Engine
    from ksana_llm.api.outputs import RequestOutput
    from ksana_llm.api.stats import EngineStats
    from ksana_llm.generation_config import GenerationConfig

__all__ = ["DEFAULT_PREFIX", "FAILURE_REASONS", "FINISH_REASONS", "ServerMetrics", "TokenTimer",
           "check_prefix", "mount"]

logger = logging.getLogger("ksana_llm.server.metrics")

DEFAULT_PREFIX = "ksana_llm"  # series are named "<prefix>:<name>"
_PREFIX_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FINISH_REASONS = ("stop", "length", "abort")
# A closed set keeps the label's cardinality bounded; anything else is counted as "other".
FAILURE_REASONS = ("invalid_request", "queue_full", "aborted", "engine_error", "unauthorized",
                   "timeout", "other")

# Buckets follow vLLM's, so dashboards built for it read ours unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# vLLM's for request_params_n.
N_BUCKETS = (1, 2, 5, 10, 20)
# Token counts without a model length to scale to (an app built without an engine).
DEFAULT_MAX_MODEL_LEN = 8192

StatsSource = Callable[[], "EngineStats"]


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets for per-request token counts:
    prompt and generated tokens, max_tokens)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_value:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


def check_prefix(prefix: str) -> str:
    """`prefix` if it can start a Prometheus series name (`vllm`, `ksana_llm`), else ValueError."""
    if not isinstance(prefix, str) or not _PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(f"metrics prefix must be letters, digits and underscores, not starting "
                         f"with a digit (e.g. vllm); got {prefix!r}")
    return prefix


class _EngineCollector(Collector):
    """Reads `engine.stats()` once per scrape and exposes it as gauges and a counter."""

    def __init__(self, model_name: str, prefix: str) -> None:
        self.model_name = model_name
        self.prefix = prefix + ":"
        self.source: StatsSource | None = None

    def describe(self) -> list[Metric]:
        # Returning nothing stops the registry from calling collect() at registration time.
        return []

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        try:
            stats = self.source()
        except Exception:  # a dead engine must not break the scrape of the other series
            logger.exception("engine.stats() failed; engine gauges left out of this scrape")
            return
        labels = [self.model_name]
        gauges = (
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("num_requests_swapped", "Requests swapped out to the host pool.", stats.num_swapped),
            ("kv_cache_usage_perc", "Share of device KV blocks in use (1 = full).",
             stats.kv_cache_usage),
            ("prefix_cache_hit_rate", "Share of queried prompt blocks found in the prefix cache.",
             stats.prefix_cache_hit_rate),
            ("num_kv_blocks", "Device KV-cache blocks in total.", stats.num_kv_blocks),
            ("num_free_kv_blocks", "Device KV-cache blocks not held by live sequences.",
             stats.num_free_kv_blocks),
            ("avg_generation_throughput_toks_per_s", "Generated tokens per second, recent window.",
             stats.generation_tokens_per_s),
        )
        counters = (
            ("num_preemptions", "Preemptions since start.", stats.num_preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.num_prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.num_prefix_cache_hits),
            ("spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).",
             stats.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted (speculative decoding).",
             stats.num_accepted_draft_tokens),
            ("spec_decode_num_drafts", "Sequence-steps that verified drafts (speculative "
             "decoding).", stats.num_drafts),
            ("kv_transfer_imported_tokens", "Prompt tokens whose KV came from a prefill server.",
             stats.num_imported_kv_tokens),
            ("kv_transfer_exported_tokens", "Prompt tokens whose KV was kept for a decode server.",
             stats.num_exported_kv_tokens),
        )
        for kind, series in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in series:
                family = kind(self.prefix + name, doc, labels=["model_name"])
                family.add_metric(labels, float(value))
                yield family
        if stats.num_accepted_draft_tokens_per_position:
            # vLLM's: one series per draft position, where acceptance falls off.
            per_position = CounterMetricFamily(
                self.prefix + "spec_decode_num_accepted_tokens_per_pos",
                "Drafts accepted at each position (speculative decoding).",
                labels=["model_name", "position"])
            for position, count in enumerate(stats.num_accepted_draft_tokens_per_position):
                per_position.add_metric([self.model_name, str(position)], float(count))
            yield per_position
        if stats.iteration_tokens is not None:
            steps = HistogramMetricFamily(self.prefix + "iteration_tokens_total",
                                          "Tokens computed per engine step.",
                                          labels=["model_name"])
            steps.add_metric(labels, stats.iteration_tokens.cumulative(),
                             stats.iteration_tokens.sum)
            yield steps
        if stats.max_loras:
            # vLLM's info gauge (the labels carry the data; the value is the scrape time), which
            # LoRA-aware routers read to send requests where their adapter already runs.
            info = GaugeMetricFamily(
                self.prefix + "lora_requests_info", "LoRA adapters of running and waiting requests.",
                labels=["model_name", "max_lora", "running_lora_adapters",
                        "waiting_lora_adapters"])
            info.add_metric([self.model_name, str(stats.max_loras),
                             ",".join(stats.running_lora_adapters),
                             ",".join(stats.waiting_lora_adapters)], time.time())
            yield info


class TokenTimer:
    """Per-request clock for inter-token latency: one `tick()` per streamed chunk of new tokens.

    The first tick only sets the reference (the first token's delay is TTFT, recorded by
    `observe_finished`); each later tick observes the gap since the previous one. Not shared
    between requests, so it needs no lock.
    """

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._last: float | None = None

    def tick(self, now: float | None = None) -> float | None:
        """Record a chunk at `now` (default: time.monotonic()); returns the gap observed, if any."""
        now = time.monotonic() if now is None else now
        gap = None if self._last is None else max(0.0, now - self._last)
        if gap is not None:
            self._histogram.observe(gap)
        self._last = now
        return gap


# The classic text format generate_latest writes (prometheus_client 0.26 labels it
# "version=1.0.0", which scrapers that predate it may not take).
PROMETHEUS_TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """All Prometheus series of one server, in a registry of its own.

    Thread-safe: prometheus_client metrics lock internally, and the only other state (the bound
    stats source) is set once at mount time.
    """

    def __init__(self, engine: Engine | None = None, *, model_name: str = "ksana_llm",
                 prefix: str = DEFAULT_PREFIX, max_model_len: int | None = None) -> None:
        """`max_model_len` (default: the engine's) bounds the token-count histograms' buckets."""
        check_prefix(prefix)
        if max_model_len is None:
            max_model_len = getattr(engine, "max_model_len", None) or DEFAULT_MAX_MODEL_LEN
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine_collector = _EngineCollector(model_name, prefix)
        series = prefix + ":"
        self.registry.register(self._engine_collector)
        if engine is not None:
            self.bind(engine)
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(series + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(series + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens",
                                     "Prompt tokens of finished requests that were scheduled."
                                     ).labels(model_name)
        self.generation_tokens = counter("generation_tokens",
                                         "Generated tokens of finished requests.").labels(model_name)
        self._success = counter("request_success", "Finished requests by finish reason.",
                                ("finished_reason",))
        self._failure = counter("request_failure", "Failed or refused requests by reason.",
                                ("reason",))
        for reason in FINISH_REASONS:  # export zeros, so rate() works from the first scrape
            self._success.labels(model_name, reason)
        for reason in FAILURE_REASONS:
            self._failure.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Seconds from arrival to the first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Seconds between streamed chunks of one request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Seconds from arrival to the last token.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Seconds a request waited before it was scheduled.",
                                    REQUEST_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Per request: (latency - TTFT) / (generated tokens - 1).", ITL_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Seconds from first scheduled to the first token.",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Seconds from the first token to the last.", REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Seconds from first scheduled to the last token.",
                                        REQUEST_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Prompt tokens per finished request.", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Generated tokens per finished request (every returned sequence).", tokens)
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Generated tokens of a finished request's longest sequence.", tokens)
        self.request_params_n = histogram("request_params_n",
                                          "The n parameter of finished requests.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens parameter of finished requests.", tokens)

    def bind(self, engine: Engine | StatsSource) -> None:
        """Read gauges from this engine (or any zero-argument callable returning EngineStats)."""
        self._engine_collector.source = engine.stats if hasattr(engine, "stats") else engine

    # ---- per request ---------------------------------------------------------------------------
    def token_timer(self) -> TokenTimer:
        """A fresh inter-token clock for one streaming request."""
        return TokenTimer(self.itl)

    def observe_finished(self, output: RequestOutput, queue_time: float | None = None,
                         config: GenerationConfig | None = None) -> None:
        """Record one request the engine returned (any finish reason, including "abort");
        `config`, its generation settings, feeds the request_params_* series."""
        # Every returned sequence counts (n > 1, beams), as the usage the client sees does.
        lengths = [len(seq.token_ids) for seq in output.sequences]
        num_generated = sum(lengths)
        timing = output.metrics
        if timing.first_scheduled_time is not None:  # aborted while waiting: no prefill
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.request_prompt_tokens.observe(len(output.prompt_token_ids))
            self.request_generation_tokens.observe(num_generated)
            self.request_max_generation_tokens.observe(max(lengths, default=0))
            if timing.first_token_time is not None:
                self.prefill_time.observe(max(0.0, timing.first_token_time
                                              - timing.first_scheduled_time))
            if timing.finished_time is not None:
                self.inference_time.observe(max(0.0, timing.finished_time
                                                - timing.first_scheduled_time))
            if timing.first_token_time is not None and timing.finished_time is not None:
                self.decode_time.observe(max(0.0, timing.finished_time - timing.first_token_time))
        if config is not None:
            self.request_params_n.observe(config.num_return_sequences)
            self.request_params_max_tokens.observe(config.max_new_tokens)
        self.generation_tokens.inc(num_generated)
        reason = output.finish_reason if output.finish_reason in FINISH_REASONS else "abort"
        self._success.labels(self.model_name, reason).inc()
        ttft, latency = output.metrics.ttft, output.metrics.latency
        if ttft is not None:
            self.ttft.observe(max(0.0, ttft))
        if latency is not None:
            self.e2e.observe(max(0.0, latency))
        if queue_time is not None:
            self.queue_time.observe(max(0.0, queue_time))
        steps = len(output.token_ids)  # sequence 0: the sequences decode side by side
        # Tokens that all came at once (beam search and best_of answer at the end) tell no time
        # per token: a 0 would only drag the histogram down.
        if ttft is not None and latency is not None and steps > 1 and latency > ttft:
            self.tpot.observe((latency - ttft) / (steps - 1))

    def observe_forward_finished(self, num_prompt_tokens: int) -> None:
        """Record one forward-only engine request (an embedding, a score, a classification,
        a /forward request) that finished: its prompt was computed, nothing generated."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self._success.labels(self.model_name, "stop").inc()

    def count_failure(self, reason: str) -> None:
        """Count a request that was refused or failed; unknown reasons count as "other"."""
        label = reason if reason in FAILURE_REASONS else "other"
        self._failure.labels(self.model_name, label).inc()

    # ---- exposition ----------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The exposition text (Prometheus text format 0.0.4) and its content type; engine
        gauges are read now.

        Always this format, whatever the scraper's Accept header asks: prometheus_client's
        OpenMetrics output renames the samples of a name with a colon (ours, as vLLM's) to
        underscores but not their `# HELP` / `# TYPE` lines, which no parser accepts (it
        answers Prometheus 2's default Accept header so). Every Prometheus reads this format.
        """
        return generate_latest(self.registry), PROMETHEUS_TEXT_FORMAT


def mount(app: FastAPI, engine: Engine | StatsSource | None, metrics: ServerMetrics) -> None:
    """Add `GET /metrics` to `app`, reading gauges from `engine` (if given) on every scrape."""
    if engine is not None:
        metrics.bind(engine)

    async def get_metrics(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    app.add_api_route("/metrics", get_metrics, methods=["GET"], include_in_schema=False)
