"""The load client's input files and flags (`ksana-llm bench`, `benchmarks/benchmark_throughput.py`):
KsanaLLM's flags end to end into the request bodies, sent to a small recording HTTP server, and
the vLLM equivalents its OpenAI backends send; the rest of the client:
tests/test_benchmark_client.py."""

from __future__ import annotations

import csv
import json
import logging
import math
import random
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from ksana_llm.bench.client import (
    BenchConfig,
    build_parser,
    config_from_args,
    main,
)
from ksana_llm.bench.request_bodies import build_request
from ksana_llm.bench.results import read_prompts
from tests.server_process import stub_http_server

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CSV = str(REPO / "ksana_llm" / "bench" / "sample_prompts.csv")


# ---- files and flags -----------------------------------------------------------------------------

def test_read_prompts_skips_header_and_cycles(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text('id,question\n1,"a, b"\n2,c\n', encoding="utf-8")
    assert read_prompts(path, col_idx=1) == ["a, b", "c"]
    assert read_prompts(path, col_idx=1, prompt_num=5) == ["a, b", "c", "a, b", "c", "a, b"]
    with pytest.raises(ValueError, match="no column 3"):
        read_prompts(path, col_idx=3)


def test_sample_prompts_ship_with_the_package_and_are_the_default():
    from importlib.resources import files

    packaged = files("ksana_llm.bench") / "sample_prompts.csv"
    assert Path(build_parser().parse_args([]).input_csv) == Path(str(packaged))
    prompts = read_prompts(str(packaged))
    assert len(prompts) >= 20 and len(set(prompts)) == len(prompts)


def test_flags_and_payloads():
    args = build_parser().parse_args(["--backend", "ksana", "--stream", "--percentiles", "50,90,99",
                                      "--request_rate", "inf", "--max_new_tokens", "8",
                                      "--ignore_eos", "--api-key", "k"])
    cfg = config_from_args(args)
    assert cfg.percentiles == (50.0, 90.0, 99.0) and math.isinf(cfg.request_rate)
    path, body = build_request(cfg, "hi")
    assert path == "/generate"
    # KsanaLLM's client sends every sampling key, with its names and defaults (greedy: topk 1).
    assert body == {"prompt": "hi", "stream": True, "sampling_config": {
        "max_new_tokens": 8, "temperature": 0.0, "topk": 1, "topp": 1.0,
        "repetition_penalty": 1.0, "num_beams": 1, "num_return_sequences": 1,
        "length_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
        "decoder_no_repeat_ngram_size": 0, "logprobs": 0, "stop_token_ids": [],
        "stop_strings": [], "ignore_eos": True}}
    # --chat_template: a plain prompt goes as one user message (the server reads the prompt as
    # the JSON text of a message list then); a message list goes as it is.
    chat = BenchConfig(backend="ksana", chat_template=True)
    body = build_request(chat, "hi")[1]
    assert body["use_chat_template"] is True
    assert json.loads(body["prompt"]) == [{"role": "user", "content": "hi"}]
    listed = json.dumps([{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "hi"}])
    assert build_request(chat, listed)[1]["prompt"] == listed
    openai = BenchConfig(backend="openai", stream=True, model="m", max_new_tokens=4)
    path, body = build_request(openai, "hi")
    assert path == "/v1/completions" and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and body["max_tokens"] == 4
    assert body["top_k"] == 1 and body["top_p"] == 1.0 and "logprobs" not in body
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--percentiles", "50,x"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--request_rate", "0"])


# ---- KsanaLLM's flags, end to end into the request bodies ----------------------------------------

class _Recorder(BaseHTTPRequestHandler):
    """Records every POST body and answers like the server would (one token-bearing answer).
    A stand-in server on purpose: these tests check what the *client* sends."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes
    bodies: list = []

    def log_message(self, *args):
        pass

    def _answer(self, payload: bytes, ctype: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):
        self._answer(json.dumps({"data": [{"id": "served-model"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append((self.path, body))
        if self.path == "/generate":
            chunk = {"texts": ["ab"], "output_token_ids": [[7, 8]], "input_token_ids": [1, 2, 3]}
            if body["stream"]:
                self._answer(b"".join(json.dumps({**chunk, "output_token_ids": [[7, 8][:n]]}
                                                 ).encode() + b"\0" for n in (1, 2)))
            else:
                self._answer(json.dumps(chunk).encode())
        else:
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            if body["stream"]:
                events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                          {"choices": [], "usage": usage}]
                self._answer(b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
                             + b"data: [DONE]\n\n", "text/event-stream")
            else:
                self._answer(json.dumps({"choices": [{"text": "ab"}], "usage": usage}).encode())


@pytest.fixture()
def recorder():
    _Recorder.bodies = []
    with stub_http_server(_Recorder) as url:
        yield int(url.rsplit(":", 1)[1]), _Recorder.bodies


def test_ksana_readme_command_and_upstream_flags_reach_generate(recorder, tmp_path):
    port, bodies = recorder
    perf, out = tmp_path / "perf.csv", tmp_path / "out.csv"
    # KsanaLLM README's benchmark command (4.3.4), plus the sampling and load flags of its client.
    code = main(["--host", "127.0.0.1", "--port", str(port), "--prompt_num", "2",
                 "--input_csv", SAMPLE_CSV, "--stream", "--backend", "ksana",
                 "--model_type", "qwen", "--mode", "async", "--request_rate", "50",
                 "--output_csv", str(out), "--perf_csv", str(perf),
                 "--topk", "5", "--topp", "0.9", "--temperature", "0.7",
                 "--repetition_penalty", "1.1", "--num_beams", "1", "--logprobs", "2",
                 "--stop_strings", "a b", "c", "--no_repeat_ngram_size", "3",
                 "--structured_output_regex", "[a-z]+", "--max_new_tokens", "4",
                 "--shuffle", "--seed", "3", "--warmup_num_iters", "1", "--random",
                 "--dataset_name", "customize", "--show_decode_token_throughput",
                 "--percentiles", "50", "99", "--tokenizer_path", "unused-without-random-ids"])
    assert code == 0
    assert len(bodies) == 4  # one warm-up pass and one measured pass of two prompts
    shuffled = read_prompts(SAMPLE_CSV, shuffle_rng=random.Random(3))[:2]
    assert shuffled != read_prompts(SAMPLE_CSV)[:2]
    assert [b["prompt"] for _, b in bodies] == shuffled * 2
    for path, body in bodies:
        assert path == "/generate"
        assert body["model_type"] == "qwen" and body["stream"] is True
        assert body["structured_output_regex"] == "[a-z]+"
        assert body["sampling_config"] == {
            "max_new_tokens": 4, "temperature": 0.7, "topk": 5, "topp": 0.9,
            "repetition_penalty": 1.1, "num_beams": 1, "num_return_sequences": 1,
            "length_penalty": 1.0, "no_repeat_ngram_size": 3, "encoder_no_repeat_ngram_size": 0,
            "decoder_no_repeat_ngram_size": 0, "logprobs": 2,
            "stop_token_ids": [151643, 151644, 151645],  # KsanaLLM's qwen default
            "stop_strings": ["a b", "c"], "ignore_eos": False}
    header, values = list(csv.reader(perf.open()))
    row = dict(zip(header, map(float, values)))
    assert row["Successful requests"] == 2 and row["Request rate"] == 50  # warm-up not counted
    assert "P50 TTFT" in row and "P99 TPOT" in row
    assert row["Token throughput"] == row["Decode token throughput"]  # 1 decode token each
    assert len(list(csv.reader(out.open()))) == 3


def test_openai_backends_send_the_vllm_equivalents(recorder):
    port, bodies = recorder
    common = ["--host", "127.0.0.1", "--port", str(port), "--input_csv", SAMPLE_CSV,
              "--prompt_num", "1", "--max_new_tokens", "4"]
    assert main([*common, "--backend", "vllm", "--stream", "--topk", "5", "--topp", "0.9",
                 "--repetition_penalty", "1.1", "--logprobs", "2", "--stop_strings", "x",
                 "--stop_token_ids", "7", "--ignore_eos", "--model_type", "llama"]) == 0
    path, body = bodies[-1]
    prompt = read_prompts(SAMPLE_CSV)[0]
    assert path == "/v1/completions"
    assert body == {"prompt": f"[INST]{prompt}[/INST]", "max_tokens": 4, "temperature": 0.0,
                    "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1, "logprobs": 2,
                    "stop": ["x"], "stop_token_ids": [7], "ignore_eos": True,
                    "model": "served-model", "stream": True,
                    "stream_options": {"include_usage": True}}
    # This server's OpenAI API also takes beams (no top_k: beams do not sample).
    assert main([*common, "--backend", "openai", "--num_beams", "3", "--length_penalty", "0.8"]) == 0
    _, body = bodies[-1]
    assert body["use_beam_search"] is True and body["num_beams"] == 3
    assert body["length_penalty"] == 0.8 and "top_k" not in body and body["prompt"] == prompt


@pytest.mark.parametrize("argv, needle", [
    (["--backend", "vllm", "--num_beams", "2"], "--backend vllm cannot express --num_beams > 1"),
    (["--backend", "vllm", "--no_repeat_ngram_size", "2"], "--no_repeat_ngram_size"),
    (["--backend", "openai", "--encoder_no_repeat_ngram_size", "2"],
     "--backend openai cannot express --encoder_no_repeat_ngram_size"),
    (["--backend", "openai", "--chat_template"], "--chat_template"),
    (["--num_return_sequences", "2"], "one sequence per request"),
    (["--dataset_name", "sharegpt500"], "pass its CSV as --input_csv"),
    (["--dataset_name", "longbenchV2withCtx"], "LongBench v2 is not supported"),
    (["--backend", "trt-llm"], "does not speak"),
    (["--max_first_token_latency", "1"], "needs --stream"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--percentiles", "50", "101"], "[0, 100]"),
    (["--random_workloads", "3"], "unrecognized arguments"),  # no prefix matching
    (["--port", "99999"], "argument --port: must be >= 1 and <= 65535"),  # (was a traceback)
    (["--port", "0"], "argument --port"),
    # Written after the whole run: a missing folder fails before it, not after.
    (["--perf_csv", "/nonexistent/perf.csv"], "--perf_csv /nonexistent/perf.csv: its folder"),
    (["--output_csv", "/nonexistent/out.csv"], "--output_csv"),
])
def test_what_cannot_be_done_is_a_usage_error(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_flags_without_effect_here_are_accepted_with_a_warning(recorder, caplog):
    port, bodies = recorder
    with caplog.at_level(logging.WARNING, logger="ksana_llm.bench"):
        assert main(["--host", "127.0.0.1", "--port", str(port), "--input_csv", SAMPLE_CSV,
                     "--prompt_num", "1", "--triton_model_name", "x"]) == 0
    assert len(bodies) == 1
    assert "--triton_model_name has no effect" in caplog.text



class _Drifting(_Recorder):
    """/generate answering the second prompt differently the second time it is asked."""

    seen: dict = {}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        seen = type(self).seen
        times = seen[body["prompt"]] = seen.get(body["prompt"], 0) + 1
        drifted = times > 1 and len(seen) > 1 and body["prompt"] == list(seen)[1]
        text = "a dog ran on the beach" if drifted else "the cat sat on the mat"
        self._answer(json.dumps({"texts": [text], "output_token_ids": [[7, 8]],
                                 "input_token_ids": [1, 2]}).encode())


def test_diff_check_compares_the_runs_answers(tmp_path, capsys):
    _Drifting.seen = {}
    report = tmp_path / "diff.txt"
    with stub_http_server(_Drifting) as url:
        # KsanaLLM's documented diff-check command; --repeat_num_iters 1 is raised to 2.
        assert main(["--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
                     "--input_csv", SAMPLE_CSV, "--prompt_num", "2", "--mode", "sync",
                     "--enable_diff_check", "--repeat_num_iters", "1",
                     "--diff_rouge_threshold", "0.5", "--diff_mismatch_threshold", "10",
                     "--diff_output_file", str(report)]) == 0
    assert sorted(_Drifting.seen.values()) == [2, 2]  # two runs of two prompts
    out = capsys.readouterr().out
    assert "diff check, run 1 vs run 2: 1/2 answers identical, 1 flagged" in out
    text = report.read_text(encoding="utf-8")
    assert "--- request 1: ROUGE-W" in text and "first mismatch at 1 <= 10" in text
    assert "the cat sat on the mat" in text and "a dog ran on the beach" in text
    assert "request 0" not in text


def test_upstream_spellings_parse():
    args = build_parser().parse_args(["--random", "--percentiles", "50", "90,99",
                                      "--tokenizer_path", "tok", "--dataset_path", "x.csv"])
    cfg = config_from_args(args)
    assert cfg.poisson and cfg.percentiles == (50.0, 90.0, 99.0)
    assert args.tokenizer == "tok" and args.input_csv == "x.csv"
    assert cfg.backend == "ksana" and cfg.concurrency == 1  # KsanaLLM's defaults
    default = config_from_args(build_parser().parse_args([]))
    assert not default.poisson and default.model_type is None


def test_the_offline_benchmarks_use_the_clients_workload():
    """`--random_workload` sends what offline_throughput.py runs: one builder, one seed rule."""
    import numpy as np

    from benchmarks import workload as offline
    from ksana_llm.bench import workload

    assert offline.build_workload is workload.build_workload
    built = workload.build_workload(5, 4, 9, 7, np.arange(3, 500))
    again = offline.build_workload(5, 4, 9, 7, np.arange(3, 500))
    assert built.prompts == again.prompts and built.summary()["num_requests"] == 5
    assert all(4 <= len(p) <= 9 for p in built.prompts)


def test_script_is_the_package_client():
    from benchmarks import benchmark_throughput
    from ksana_llm.bench import client

    assert benchmark_throughput.main is client.main
    assert benchmark_throughput.BenchConfig is client.BenchConfig
