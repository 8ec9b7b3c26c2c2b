"""ServerMetrics against a real engine: counters equal real token counts, histograms count the
requests, gauges mirror engine.stats(), and GET /metrics serves the Prometheus text format.
A real server's counts (each HTTP request once, by how it ended) are in test_server_metrics.py."""

from __future__ import annotations

import json

import pytest

import ksana_llm as kt
from ksana_llm.api.outputs import RequestMetrics, RequestOutput
from ksana_llm.api.stats import EngineStats
from ksana_llm.server.metrics import FAILURE_REASONS, ServerMetrics, mount, token_buckets
from tests.prometheus_samples import samples, value

MODEL = "smollm2"


@pytest.fixture(scope="module")
def engine(default_model_dir):
    model = kt.Model.from_pretrained(default_model_dir, device="cpu", progress=False)
    eng = kt.Engine(model, num_device_blocks=64)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def outputs(engine):
    prompts = ["What is the capital of France?", "Count: one, two, three,", "Hello"]
    configs = [kt.GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (5, 3, 1)]
    return engine.generate_outputs(prompts, configs, use_tqdm=False)


def test_counters_and_histograms_match_real_requests(engine, outputs):
    metrics = ServerMetrics(engine, model_name=MODEL)
    for i, out in enumerate(outputs):
        metrics.observe_finished(out, queue_time=0.001 * i)
    body, content_type = metrics.render()
    parsed = samples(body.decode())

    assert content_type.startswith("text/plain")
    assert value(parsed, "ksana_llm:prompt_tokens_total") == sum(len(o.prompt_token_ids) for o in outputs)
    assert value(parsed, "ksana_llm:generation_tokens_total") == sum(len(o.token_ids) for o in outputs) == 9
    assert value(parsed, "ksana_llm:request_success_total", finished_reason="length") == 3
    assert value(parsed, "ksana_llm:request_success_total", finished_reason="stop") == 0
    n = len(outputs)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert value(parsed, f"ksana_llm:{name}_count") == n, name
        assert value(parsed, f"ksana_llm:{name}_bucket", le="+Inf") == n, name
    assert value(parsed, "ksana_llm:e2e_request_latency_seconds_sum") == pytest.approx(
        sum(o.metrics.latency for o in outputs))
    assert value(parsed, "ksana_llm:time_to_first_token_seconds_sum") == pytest.approx(
        sum(o.metrics.ttft for o in outputs))
    # TPOT needs two tokens: the 1-token request has none.
    assert value(parsed, "ksana_llm:request_time_per_output_token_seconds_count") == 2
    # vLLM's per-request token histograms and phase times, from the same outputs.
    assert value(parsed, "ksana_llm:request_prompt_tokens_sum") == sum(
        len(o.prompt_token_ids) for o in outputs)
    assert value(parsed, "ksana_llm:request_generation_tokens_sum") == 9
    assert value(parsed, "ksana_llm:request_generation_tokens_bucket", le="2.0") == 1  # the 1
    assert value(parsed, "ksana_llm:request_max_num_generation_tokens_sum") == 9
    phases = {"request_prefill_time_seconds": lambda m: m.first_token_time - m.first_scheduled_time,
              "request_decode_time_seconds": lambda m: m.finished_time - m.first_token_time,
              "request_inference_time_seconds": lambda m: m.finished_time - m.first_scheduled_time}
    for name, span in phases.items():
        assert value(parsed, f"ksana_llm:{name}_count") == n, name
        assert value(parsed, f"ksana_llm:{name}_sum") == pytest.approx(
            sum(span(o.metrics) for o in outputs)), name
    # Without the requests' configs there is nothing to say of their parameters.
    assert value(parsed, "ksana_llm:request_params_n_count") == 0


def test_request_parameters_and_longest_sequence(engine):
    """request_params_n / request_params_max_tokens from the request's config, and
    request_max_num_generation_tokens from its longest returned sequence (a stop string may end
    one sample early)."""
    config = kt.GenerationConfig(max_new_tokens=6, num_return_sequences=3, do_sample=True,
                                 seed=3, stop=["."])
    out = engine.generate_outputs("Tell me a story", config, use_tqdm=False)[0]
    lengths = [len(seq.token_ids) for seq in out.sequences]
    metrics = ServerMetrics(engine, model_name=MODEL)
    metrics.observe_finished(out, config=config)
    parsed = samples(metrics.render()[0].decode())
    assert value(parsed, "ksana_llm:request_params_n_count") == 1
    assert value(parsed, "ksana_llm:request_params_n_sum") == 3
    assert value(parsed, "ksana_llm:request_params_n_bucket", le="2.0") == 0
    assert value(parsed, "ksana_llm:request_params_n_bucket", le="5.0") == 1
    assert value(parsed, "ksana_llm:request_params_max_tokens_sum") == 6
    assert value(parsed, "ksana_llm:request_generation_tokens_sum") == sum(lengths)
    assert value(parsed, "ksana_llm:request_max_num_generation_tokens_sum") == max(lengths)


def test_token_buckets_are_vllms_1_2_5_series_up_to_the_model_length():
    assert token_buckets(1) == (1,)
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    metrics = ServerMetrics(model_name=MODEL, max_model_len=600)
    parsed = samples(metrics.render()[0].decode())
    bounds = {dict(labels).get("le") for (name, labels) in parsed
              if name == "ksana_llm:request_prompt_tokens_bucket"}
    assert bounds == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0",
                      "+Inf"}


def test_iteration_tokens_count_each_step_of_the_engine(engine):
    """vLLM's iteration_tokens_total: one observation per engine step, of the tokens it
    computed. One request alone: its prompt in one step, then one token a step; the last
    sampled token is never computed."""
    before = engine.stats().iteration_tokens
    out = engine.generate_outputs("Count: one, two, three,", kt.GenerationConfig(
        max_new_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    after = engine.stats().iteration_tokens
    prompt = len(out.prompt_token_ids)
    assert after.count - before.count == 5
    assert after.sum - before.sum == prompt + 4
    grew = [b - a for a, b in zip(before.counts, after.counts)]
    one = after.buckets.index(1)
    assert grew[one] == 4  # the decode steps
    prefill_bucket = next(i for i, bound in enumerate(after.buckets) if prompt <= bound)
    assert grew[prefill_bucket] == 1 and sum(grew) == 5
    metrics = ServerMetrics(engine, model_name=MODEL)
    parsed = samples(metrics.render()[0].decode())
    stats = engine.stats().iteration_tokens
    assert value(parsed, "ksana_llm:iteration_tokens_total_count") == stats.count
    assert value(parsed, "ksana_llm:iteration_tokens_total_sum") == stats.sum
    assert value(parsed, "ksana_llm:iteration_tokens_total_bucket", le="1.0") == stats.counts[0]
    assert value(parsed, "ksana_llm:iteration_tokens_total_bucket", le="+Inf") == stats.count
    # /v1/stats serves as_dict() as JSON: the histogram as plain lists.
    shown = json.loads(json.dumps(engine.stats().as_dict()))["iteration_tokens"]
    assert sum(shown["counts"]) == stats.count and shown["buckets"] == list(stats.buckets)


def test_beams_that_arrive_at_once_give_no_time_per_token(engine):
    """Beam search answers at the end (first token time = end): no TPOT sample of 0."""
    beams = engine.generate_outputs("Hello", kt.GenerationConfig(
        max_new_tokens=4, num_beams=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(beams.token_ids) > 1 and beams.metrics.ttft == pytest.approx(beams.metrics.latency)
    metrics = ServerMetrics(engine, model_name=MODEL)
    metrics.observe_finished(beams)
    parsed = samples(metrics.render()[0].decode())
    assert value(parsed, "ksana_llm:request_time_per_output_token_seconds_count") == 0
    assert value(parsed, "ksana_llm:e2e_request_latency_seconds_count") == 1


def test_gauges_reflect_engine_stats(engine, outputs):
    metrics = ServerMetrics(engine, model_name=MODEL)
    parsed = samples(metrics.render()[0].decode())
    stats = engine.stats()  # idle engine: nothing moves between the scrape and this call
    assert value(parsed, "ksana_llm:num_requests_running") == stats.num_running == 0
    assert value(parsed, "ksana_llm:num_requests_waiting") == stats.num_waiting == 0
    assert value(parsed, "ksana_llm:num_requests_swapped") == stats.num_swapped
    assert value(parsed, "ksana_llm:kv_cache_usage_perc") == stats.kv_cache_usage
    assert value(parsed, "ksana_llm:prefix_cache_hit_rate") == pytest.approx(stats.prefix_cache_hit_rate)
    assert value(parsed, "ksana_llm:num_kv_blocks") == 64
    assert value(parsed, "ksana_llm:num_preemptions_total") == stats.num_preemptions


def test_prefix_cache_token_counters(engine):
    """vLLM's prefix_cache_queries / prefix_cache_hits: prompt tokens looked up and found, from
    the engine's own lookups; their ratio is the hit-rate gauge."""
    prompt = "A long shared instruction prefix that the cache keeps between requests: " * 3
    for _ in range(2):
        engine.generate_outputs(prompt, kt.GenerationConfig(max_new_tokens=1), use_tqdm=False)
    metrics = ServerMetrics(engine, model_name=MODEL)
    parsed = samples(metrics.render()[0].decode())
    stats = engine.stats()
    queries = value(parsed, "ksana_llm:prefix_cache_queries_total")
    hits = value(parsed, "ksana_llm:prefix_cache_hits_total")
    assert (queries, hits) == (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits)
    assert hits >= len(engine.tokenizer.encode(prompt)) // 16 * 16 - 16 > 0  # the second lookup
    assert hits / queries == pytest.approx(value(parsed, "ksana_llm:prefix_cache_hit_rate"))


def test_gauges_are_read_at_scrape_time():
    state = {"stats": EngineStats(3, 2, 1, 0.5, 64, 32, 7, 0.25, 0, 12.5, None, None, None, None)}
    metrics = ServerMetrics(model_name=MODEL)
    metrics.bind(lambda: state["stats"])
    parsed = samples(metrics.render()[0].decode())
    assert value(parsed, "ksana_llm:num_requests_waiting") == 3
    assert value(parsed, "ksana_llm:num_requests_running") == 2
    assert value(parsed, "ksana_llm:num_requests_swapped") == 1
    assert value(parsed, "ksana_llm:kv_cache_usage_perc") == 0.5
    assert value(parsed, "ksana_llm:prefix_cache_hit_rate") == 0.25
    assert value(parsed, "ksana_llm:num_preemptions_total") == 7
    assert value(parsed, "ksana_llm:spec_decode_num_draft_tokens_total") == 0
    assert not any(name == "ksana_llm:spec_decode_num_accepted_tokens_per_pos_total"
                   for name, _ in parsed)  # no positions before any draft
    state["stats"] = EngineStats(0, 9, 0, 0.75, 64, 16, 8, 0.5, 0, 0.0, None, None, None, None,
                                 num_draft_tokens=40, num_accepted_draft_tokens=30,
                                 num_drafts=20, num_accepted_draft_tokens_per_position=(18, 12))
    parsed = samples(metrics.render()[0].decode())
    assert value(parsed, "ksana_llm:num_requests_running") == 9
    assert value(parsed, "ksana_llm:num_preemptions_total") == 8
    assert value(parsed, "ksana_llm:spec_decode_num_draft_tokens_total") == 40
    assert value(parsed, "ksana_llm:spec_decode_num_accepted_tokens_total") == 30
    assert value(parsed, "ksana_llm:spec_decode_num_drafts_total") == 20
    per_position = "ksana_llm:spec_decode_num_accepted_tokens_per_pos_total"
    assert {labels: v for (name, labels), v in parsed.items() if name == per_position} == {
        frozenset({("position", "0")}): 18, frozenset({("position", "1")}): 12}
    assert state["stats"].draft_acceptance_rate == 0.75
    assert state["stats"].mean_acceptance_length == 2.5


def test_failing_stats_source_does_not_break_the_scrape():
    def broken() -> EngineStats:
        raise RuntimeError("engine is dead")

    metrics = ServerMetrics(broken, model_name=MODEL)
    metrics.count_failure("engine_error")
    parsed = samples(metrics.render()[0].decode())
    assert value(parsed, "ksana_llm:request_failure_total", reason="engine_error") == 1
    assert ("ksana_llm:num_requests_running", frozenset()) not in parsed


def test_failures_by_reason_and_unknown_reason_is_other():
    metrics = ServerMetrics(model_name=MODEL)
    for reason in ("queue_full", "queue_full", "invalid_request", "no-such-reason"):
        metrics.count_failure(reason)
    parsed = samples(metrics.render()[0].decode())
    assert value(parsed, "ksana_llm:request_failure_total", reason="queue_full") == 2
    assert value(parsed, "ksana_llm:request_failure_total", reason="invalid_request") == 1
    assert value(parsed, "ksana_llm:request_failure_total", reason="other") == 1
    assert value(parsed, "ksana_llm:request_failure_total", reason="aborted") == 0
    assert {r for (name, labels), _ in parsed.items() if name == "ksana_llm:request_failure_total"
            for k, r in labels} == set(FAILURE_REASONS)


def test_inter_token_latency_from_token_timer():
    metrics = ServerMetrics(model_name=MODEL)
    timer = metrics.token_timer()
    assert timer.tick(10.0) is None  # the first chunk is TTFT's business
    assert timer.tick(10.02) == pytest.approx(0.02)
    assert timer.tick(10.07) == pytest.approx(0.05)
    other = metrics.token_timer()  # per request: never mixes gaps of two requests
    other.tick(100.0)
    parsed = samples(metrics.render()[0].decode())
    assert value(parsed, "ksana_llm:inter_token_latency_seconds_count") == 2
    assert value(parsed, "ksana_llm:inter_token_latency_seconds_sum") == pytest.approx(0.07)
    assert value(parsed, "ksana_llm:inter_token_latency_seconds_bucket", le="0.025") == 1


def test_aborted_and_unstarted_requests():
    metrics = ServerMetrics(model_name=MODEL)
    aborted = RequestOutput("r", [1, 2], finished=True, finish_reason="abort",
                            metrics=RequestMetrics(arrival_time=1.0, finished_time=1.5))
    metrics.observe_finished(aborted)
    parsed = samples(metrics.render()[0].decode())
    assert value(parsed, "ksana_llm:request_success_total", finished_reason="abort") == 1
    assert value(parsed, "ksana_llm:time_to_first_token_seconds_count") == 0  # no token came
    assert value(parsed, "ksana_llm:e2e_request_latency_seconds_count") == 1
    assert value(parsed, "ksana_llm:request_queue_time_seconds_count") == 0


def test_registries_are_independent():
    a, b = ServerMetrics(model_name=MODEL), ServerMetrics(model_name=MODEL)
    a.count_failure("queue_full")
    parsed = samples(b.render()[0].decode())
    assert value(parsed, "ksana_llm:request_failure_total", reason="queue_full") == 0


@pytest.mark.parametrize("prefix", ["", "1x", "vllm:", "a-b", None])
def test_a_metrics_prefix_that_cannot_name_a_series_is_refused(prefix):
    with pytest.raises(ValueError, match="metrics prefix"):
        ServerMetrics(model_name=MODEL, prefix=prefix)


def test_get_metrics_route(engine, outputs):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    metrics = ServerMetrics(model_name=MODEL)
    mount(app, engine, metrics)
    metrics.observe_finished(outputs[0])
    with TestClient(app) as client:
        response = client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        parsed = samples(response.text)
        assert value(parsed, "ksana_llm:num_kv_blocks") == 64
        assert value(parsed, "ksana_llm:generation_tokens_total") == len(outputs[0].token_ids)
        # Prometheus 2's default Accept header prefers OpenMetrics, which prometheus_client
        # writes with sample names that do not match their own `# TYPE` lines for names with a
        # colon: the text format answers it, and parses.
        prometheus2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                       "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
        scraped = client.get("/metrics", headers={"Accept": prometheus2})
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert value(samples(scraped.text), "ksana_llm:num_kv_blocks") == 64
