"""KsanaLLM's native `POST /generate` on a real server subprocess, driven by httpx: results equal the
Python API's, NUL-delimited cumulative streaming, num_return_sequences, stop strings, logprobs, the
error classes (400 in the server; 401/429/503 in-process), abort on disconnect, and the load client
(`benchmarks/benchmark_throughput.py`) end to end against the same server with both backends."""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import ksana_llm as kt
from tests.server_process import server_fixture, openai_error

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


server = server_fixture(["--num-device-blocks", "256"])


@pytest.fixture(scope="module")
def greedy16(local_engine):
    return local_engine.generate_outputs(PROMPT, kt.GenerationConfig(max_new_tokens=16),
                                         use_tqdm=False)[0]


def _post(server, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=kw.pop("timeout", 60), **kw)


def _chunks(response: httpx.Response) -> list[dict]:
    *chunks, tail = response.content.split(b"\0")
    assert tail == b"", "the stream must end with a NUL byte"
    return [json.loads(c) for c in chunks]


# ---- results -----------------------------------------------------------------------------------------

def test_greedy_matches_python_api(server, local_engine, greedy16):
    r = _post(server, {"prompt": PROMPT, "sampling_config": {"max_new_tokens": 16}, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json() == {"texts": [greedy16.text], "output_token_ids": [greedy16.token_ids],
                        "logprobs": [[]], "input_token_ids": local_engine.tokenizer.encode(PROMPT)}
    # Greedy is the default (topk 1) whatever the temperature; do_sample false forces it too.
    for sampling in ({"temperature": 0.7}, {"topk": 40, "temperature": 0.9, "do_sample": False}):
        r = _post(server, {"prompt": PROMPT, "stream": False,
                           "sampling_config": {"max_new_tokens": 16, **sampling}})
        assert r.json()["output_token_ids"] == [greedy16.token_ids], sampling


def test_input_tokens(server, local_engine, greedy16):
    ids = local_engine.tokenizer.encode(PROMPT)
    r = _post(server, {"input_tokens": ids, "sampling_config": {"max_new_tokens": 16}, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()["input_token_ids"] == ids
    assert r.json()["output_token_ids"] == [greedy16.token_ids]
    assert r.json()["texts"] == [greedy16.text]
    # KsanaLLM's rule: input_tokens is used instead of prompt when both are given.
    both = _post(server, {"prompt": "something else entirely", "input_tokens": ids,
                          "sampling_config": {"max_new_tokens": 16}, "stream": False})
    assert both.status_code == 200, both.text
    assert both.json()["input_token_ids"] == ids
    assert both.json()["output_token_ids"] == [greedy16.token_ids]
    # Log-probs not asked for: an empty list per sequence (KsanaLLM's shape), not null.
    assert r.json()["logprobs"] == [[]]


def test_ksana_clients_off_values_and_messages_hint(server, local_engine):
    """What KsanaLLM clients send at its defaults is accepted: additional_params {} and
    enable_thinking true or false (handed to the chat template with use_chat_template: the
    prompt tokens then equal the template rendered with it); messages gets KsanaLLM's pointer
    to the chat route."""
    import json

    messages = [{"role": "user", "content": "Hi"}]
    for thinking in (True, False):
        r = _post(server, {"prompt": json.dumps(messages), "use_chat_template": True,
                           "additional_params": {}, "stream": False,
                           "sampling_config": {"max_new_tokens": 2,
                                               "enable_thinking": thinking}})
        assert r.status_code == 200, r.text
        rendered = local_engine.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert r.json()["input_token_ids"] == local_engine.tokenizer.encode(
            rendered, add_special_tokens=False)
    r = _post(server, {"prompt": "x", "messages": messages, "stream": False})
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]


def test_stream_is_nul_delimited_and_cumulative(server):
    body = {"prompt": PROMPT, "sampling_config": {"max_new_tokens": 12}}  # stream defaults to true
    full = _post(server, {**body, "stream": False}).json()
    r = _post(server, body)
    assert r.status_code == 200 and "text/event-stream" not in r.headers["content-type"]
    chunks = _chunks(r)
    assert len(chunks) >= 3
    previous: list[int] = []
    for chunk in chunks:
        assert set(chunk) == {"texts", "output_token_ids", "logprobs", "input_token_ids"}
        tokens = chunk["output_token_ids"][0]
        assert tokens[:len(previous)] == previous and len(tokens) >= len(previous)  # cumulative
        previous = tokens
    assert chunks[-1] == full


def test_num_return_sequences_sampling(server):
    sampling = {"max_new_tokens": 8, "ignore_eos": True, "topk": 50, "temperature": 1.0,
                "do_sample": True, "num_return_sequences": 2, "seed": 7}
    r = _post(server, {"prompt": PROMPT, "sampling_config": sampling, "stream": False})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["texts"]) == 2 and [len(t) for t in out["output_token_ids"]] == [8, 8]
    assert out["output_token_ids"][0] != out["output_token_ids"][1]  # seeds 7 and 8
    again = _post(server, {"prompt": PROMPT, "sampling_config": sampling, "stream": False}).json()
    assert again == out  # same seed, same samples
    chunks = _chunks(_post(server, {"prompt": PROMPT, "sampling_config": sampling}))
    assert chunks[-1] == out


def _success_count(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ksana_llm:request_success_total"))


def test_num_return_sequences_is_one_engine_request(server):
    """n sequences share one engine request (and its prompt's KV): the metrics count one."""
    before = _success_count(server)
    r = _post(server, {"prompt": PROMPT, "stream": False, "sampling_config": {
        "max_new_tokens": 4, "num_return_sequences": 3}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["output_token_ids"]) == 3 and len(set(map(tuple, out["output_token_ids"]))) == 1
    assert _success_count(server) == before + 1


def test_the_bodies_ksana_llms_own_clients_send(server, local_engine, greedy16):
    """KsanaLLM's serving_generate_client (greedy spelled topk 1, topp 0.0) and its benchmark
    client (model_type, use_chat_template false, an empty regex, null stop_strings)."""
    tok = local_engine.tokenizer
    r = _post(server, {"prompt": PROMPT, "stream": False, "sampling_config": {
        "num_return_sequences": 1, "temperature": 0.0, "topk": 1, "topp": 0.0, "logprobs": 0,
        "max_new_tokens": 16, "repetition_penalty": 1.0, "stop_token_ids": []}})
    assert r.status_code == 200, r.text
    assert r.json()["output_token_ids"] == [greedy16.token_ids]
    bench = {"prompt": PROMPT, "stream": False, "model_type": "llama", "use_chat_template": False,
             "structured_output_regex": "", "sampling_config": {
                 "temperature": 0.0, "topk": 1, "topp": 1.0, "num_beams": 1,
                 "num_return_sequences": 1, "length_penalty": 1.0, "repetition_penalty": 1.0,
                 "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
                 "decoder_no_repeat_ngram_size": 0, "logprobs": 0, "max_new_tokens": 8,
                 "stop_token_ids": [], "stop_strings": None, "ignore_eos": False}}
    r = _post(server, bench)
    assert r.status_code == 200, r.text
    # model_type llama: the prompt in Llama 2's [INST] turn, as KsanaLLM wraps it.
    wrapped = tok.encode("[INST]" + PROMPT + "[/INST]")
    assert r.json()["input_token_ids"] == wrapped
    want = local_engine.generate_outputs(wrapped, kt.GenerationConfig(max_new_tokens=8),
                                         use_tqdm=False)[0]
    assert r.json()["output_token_ids"] == [want.token_ids]
    # An unknown model_type leaves the prompt as it is (KsanaLLM's "empty", with a warning).
    r = _post(server, {"prompt": PROMPT, "stream": False, "model_type": "nonesuch",
                       "sampling_config": {"max_new_tokens": 1}})
    assert r.json()["input_token_ids"] == tok.encode(PROMPT)
    # use_chat_template: the prompt is JSON messages for the model's own chat template.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = _post(server, {"prompt": json.dumps(messages), "use_chat_template": True, "stream": False,
                       "sampling_config": {"max_new_tokens": 8}})
    assert r.status_code == 200, r.text
    assert r.json()["input_token_ids"] == tok.encode(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_what_ksana_llm_leaves_unchecked_is_accepted(server, greedy16):
    """A null on any key (also one we do not serve) is its default; stop ids past the
    vocabulary never match (KsanaLLM's clients send a family's ids whatever the model); topp 0
    is "not used" with beam search as with greedy decoding."""
    r = _post(server, {"prompt": PROMPT, "stream": False, "messages": None, "sampling_config": {
        "max_new_tokens": 16, "enable_thinking": None, "encoder_no_repeat_ngram_size": None,
        "stop_token_ids": [151643, 151645]}})
    assert r.status_code == 200, r.text
    assert r.json()["output_token_ids"] == [greedy16.token_ids]
    r = _post(server, {"prompt": PROMPT, "stream": False, "sampling_config": {
        "max_new_tokens": 4, "num_beams": 2, "topp": 0.0}})
    assert r.status_code == 200, r.text


def test_texts_are_the_decode_of_the_output_tokens(server, local_engine, greedy16):
    """As KsanaLLM decodes them: a stop token that is not special stays in the text (the engine's
    own text drops it), EOS and other special tokens do not."""
    tok = local_engine.tokenizer
    stop = greedy16.token_ids[3]
    r = _post(server, {"prompt": PROMPT, "stream": False, "sampling_config": {
        "max_new_tokens": 16, "stop_token_ids": [stop]}})
    (tokens,) = r.json()["output_token_ids"]
    assert tokens == greedy16.token_ids[:4]
    assert r.json()["texts"] == [tok.decode(tokens, skip_special_tokens=True)]
    assert r.json()["texts"][0].endswith(tok.decode([stop]))
    chunks = _chunks(_post(server, {"prompt": PROMPT, "sampling_config": {
        "max_new_tokens": 16, "stop_token_ids": [stop]}}))
    assert chunks[-1] == r.json()
    # Every chunk says something new: the final result is not sent twice.
    assert all(a != b for a, b in zip(chunks, chunks[1:]))


def test_stop_strings_truncate(server, greedy16):
    text = greedy16.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    sampling = {"max_new_tokens": 16, "stop_strings": [stop]}
    r = _post(server, {"prompt": PROMPT, "sampling_config": sampling, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()["texts"] == [text[:text.index(stop)]]
    assert _chunks(_post(server, {"prompt": PROMPT, "sampling_config": sampling}))[-1] == r.json()


def test_logprobs(server, greedy16):
    sampling = {"max_new_tokens": 16, "logprobs": 3}
    r = _post(server, {"prompt": PROMPT, "sampling_config": sampling, "stream": False})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_token_ids"] == [greedy16.token_ids]
    (steps,) = out["logprobs"]
    assert len(steps) == len(greedy16.token_ids)
    for token, step in zip(greedy16.token_ids, steps):
        assert len(step) == 3 and all(len(pair) == 2 for pair in step)
        assert step[0][0] == token  # greedy: the chosen token is the top one
        assert [lp for _, lp in step] == sorted((lp for _, lp in step), reverse=True)
        assert all(lp <= 0 for _, lp in step)
    chunks = _chunks(_post(server, {"prompt": PROMPT, "sampling_config": sampling}))
    assert chunks[-1] == out
    for chunk in chunks:  # cumulative: each chunk's steps are the answer's first ones
        assert chunk["logprobs"] == [steps[:len(chunk["output_token_ids"][0])]]


# ---- errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, code", [
    ({"sampling_config": {"max_new_tokens": 2}}, "prompt", None),
    ({"prompt": ""}, "prompt", "empty_prompt"),
    ({"input_tokens": []}, "input_tokens", "empty_prompt"),
    ({"input_tokens": [1, 10**9]}, "input_tokens", "invalid_token_id"),
    ({"prompt": "x", "sampling_config": {"stop_token_ids": [-1]}},
     "sampling_config.stop_token_ids", "invalid_token_id"),
    ({"prompt": "x", "sampling_config": {"max_new_tokens": 10**6}},
     "sampling_config.max_new_tokens", "context_length_exceeded"),
    ({"input_tokens": [1] * 5000}, "input_tokens", "context_length_exceeded"),
    # The prompt alone is too long: it is named, not the completion asked beside it.
    ({"input_tokens": [1] * 5000, "sampling_config": {"max_new_tokens": 2}}, "input_tokens",
     "context_length_exceeded"),
    ({"prompt": "x", "sampling_config": {"foo": 1, "bar": 2}}, "sampling_config.foo", "unknown_parameter"),
    ({"prompt": "x", "frobnicate": True}, "frobnicate", "unknown_parameter"),
    ({"prompt": "x", "sampling_config": {"num_beams": 4, "do_sample": True}}, "sampling_config.do_sample",
     None),
    ({"prompt": "x", "sampling_config": {"num_beams": 4, "topk": 50}}, "sampling_config.topk", None),
    ({"prompt": "x", "sampling_config": {"num_beams": 4, "topk": 0, "temperature": 0.7}},
     "sampling_config.topk", None),
    ({"prompt": "x", "sampling_config": {"encoder_no_repeat_ngram_size": 3}},
     "sampling_config.encoder_no_repeat_ngram_size", "unsupported_parameter"),
    ({"prompt": "x", "sampling_config": {"length_penalty": 0.5}}, "sampling_config.length_penalty",
     None),
    ({"prompt": "x", "sampling_config": {"json_schema": '{"type": "nope"}', "enable_structured_output": True}},
     "sampling_config.json_schema", None),
    ({"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}, "messages",
     "unsupported_parameter"),
    ({"prompt": "x", "additional_params": {"max_pixels": 4}}, "additional_params",
     "unsupported_parameter"),
    # topp 0 is accepted with greedy decoding only (KsanaLLM's clients send it so).
    ({"prompt": "x", "sampling_config": {"topp": 0, "topk": 50, "temperature": 0.8}},
     "sampling_config.topp", None),
    ({"prompt": "not json", "use_chat_template": True}, "prompt", None),
    ({"prompt": "x", "structured_output_regex": "[ab]+", "sampling_config": {"num_beams": 2}},
     "structured_output_regex", None),
    ({"prompt": "x", "sampling_config": {"temperature": -1}}, "sampling_config.temperature", None),
    ({"prompt": "x", "sampling_config": {"logprobs": 50}}, "sampling_config.logprobs", None),
    ({"prompt": 5}, "prompt", None),
])
def test_400(server, body, param, code):
    for stream in (False, True):
        r = _post(server, {**body, "stream": stream})
        assert r.status_code == 400, r.text
        error = openai_error(r)
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def test_400_names_every_bad_key(server):
    r = _post(server, {"prompt": "x", "sampling_config": {"foo": 1, "decoder_no_repeat_ngram_size": 2,
                                                          "bar": 3}})
    message = openai_error(r)["message"]
    assert all(k in message for k in ("sampling_config.foo", "sampling_config.bar",
                                      "sampling_config.decoder_no_repeat_ngram_size")), message
    # Their "off" values are accepted.
    r = _post(server, {"prompt": "x", "stream": False, "sampling_config": {
        "num_beams": 1, "length_penalty": 1.0, "no_repeat_ngram_size": 0, "max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/generate", content=b"{not json", timeout=30)
    assert r.status_code == 400 and openai_error(r)["code"] == "invalid_json"


def test_infinite_temperature_is_a_400(server):
    for raw in (b"Infinity", b"1e400"):
        r = httpx.post(server.url + "/generate", timeout=60,
                       content=b'{"prompt": "x", "sampling_config": {"temperature": ' + raw + b"}}")
        assert r.status_code == 400 and openai_error(r)["param"] == "sampling_config.temperature"


def test_lone_surrogates_are_a_400_as_on_the_openai_routes(server):
    """An escaped lone UTF-16 surrogate is not text: Python's json module takes it (the OpenAI
    routes' parser does not), and the tokenizer then failed with a 500. A well-formed pair is
    one character and is served."""
    lone = b'"x\\ud800y"'
    for path, body in (
            ("/generate", b'{"prompt": ' + lone + b', "stream": false}'),
            ("/generate", b'{"prompt": "x", "sampling_config": {"stop_strings": [' + lone + b"]}}"),
            ("/forward", b'{"requests": [{"prompt": ' + lone
             + b', "request_target": [{"target_name": "layernorm"}]}]}'),
            ("/invocations", b'{"prompt": ' + lone + b', "max_tokens": 1}'),
            ("/v1/completions", b'{"prompt": ' + lone + b', "max_tokens": 1}')):
        r = httpx.post(server.url + path, content=body, timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        assert openai_error(r)["code"] in ("invalid_json", "invalid_body"), (path, r.text)
    # Inside the JSON text of /generate's chat messages (a valid body): a 400 naming prompt.
    messages = '[{"role": "user", "content": "\\ud800"}]'  # the escape itself, in the text
    r = _post(server, {"prompt": messages, "use_chat_template": True, "stream": False,
                       "sampling_config": {"max_new_tokens": 2}})
    assert r.status_code == 400 and openai_error(r)["param"] == "prompt", r.text
    r = httpx.post(server.url + "/generate", timeout=60, content=b'{"prompt": "x\\ud83d\\ude00",'
                   b' "stream": false, "sampling_config": {"max_new_tokens": 2}}')
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_deeply_nested_json_is_a_400_and_the_connection_still_serves(server, greedy16):
    """Nesting past the JSON decoder's recursion limit used to escape as a 500 (RecursionError)
    that also reset the client's keep-alive connection."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for _ in range(2):
            r = client.post("/generate", content=b'{"prompt": "hi", "model_name": '
                            + b"[" * 5000 + b"]" * 5000 + b"}")
            assert r.status_code == 400 and openai_error(r)["code"] == "invalid_json", r.text
        r = client.post("/generate", json={"prompt": PROMPT, "stream": False,
                                           "sampling_config": {"max_new_tokens": 16}})
        assert r.status_code == 200 and r.json()["output_token_ids"] == [greedy16.token_ids]


def test_disconnect_aborts_requests(server):
    body = {"prompt": PROMPT, "sampling_config": {"max_new_tokens": 3000, "ignore_eos": True,
                                                  "num_return_sequences": 2}}

    async def cut() -> None:
        async def streaming() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                async with http.stream("POST", server.url + "/generate", json=body) as r:
                    assert r.status_code == 200
                    buffered = b""
                    async for raw in r.aiter_bytes():
                        buffered += raw
                        if buffered.count(b"\0") >= 2:
                            return  # closes the connection mid-stream

        async def impatient() -> None:
            async with httpx.AsyncClient(timeout=0.5) as http:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(server.url + "/generate", json={**body, "stream": False})

        await asyncio.gather(*(streaming() for _ in range(3)), *(impatient() for _ in range(2)))

    asyncio.run(cut())
    deadline = time.monotonic() + 15
    while (counts := httpx.get(server.url + "/health").json()) and \
            (counts["num_running"], counts["num_waiting"]) != (0, 0):
        assert time.monotonic() < deadline, f"requests still live: {counts}"
        time.sleep(0.1)


def test_401_429_503_in_process(default_model):
    """Same statuses and bodies as the OpenAI routes, on an in-process app (no extra server)."""
    from ksana_llm.server.app import build_app

    engine = kt.Engine(default_model, num_device_blocks=64, max_num_seqs=1, max_queue_size=1)
    app = build_app(engine, served_model_name="m", api_key="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    body = {"prompt": PROMPT, "stream": False, "sampling_config": {"max_new_tokens": 16,
                                                                  "ignore_eos": True}}

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as http:
            r = await http.post("/generate", json=body)
            assert r.status_code == 401 and openai_error(r)["code"] == "invalid_api_key"
            responses = await asyncio.gather(*(http.post("/generate", json=body, headers=auth)
                                               for _ in range(6)))
            statuses = [r.status_code for r in responses]
            assert set(statuses) == {200, 429}, statuses
            for r in responses:
                if r.status_code == 429:
                    assert int(r.headers["Retry-After"]) >= 1
                    error = openai_error(r)
                    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
                else:
                    assert len(r.json()["output_token_ids"][0]) == 16
            engine.shutdown()
            for stream in (False, True):
                r = await http.post("/generate", json={**body, "stream": stream}, headers=auth)
                assert r.status_code == 503 and openai_error(r)["type"] == "service_unavailable"

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


# ---- the load client, end to end ---------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["ksana", "openai"])
def test_benchmark_client_end_to_end(server, backend, tmp_path):
    perf = tmp_path / "perf.csv"
    cmd = [sys.executable, str(REPO / "benchmarks" / "benchmark_throughput.py"),
           "--host", "127.0.0.1", "--port", str(server.port), "--backend", backend, "--stream",
           "--prompt_num", "4", "--max_new_tokens", "8",
           "--input_csv", str(REPO / "ksana_llm" / "bench" / "sample_prompts.csv"),
           "--perf_csv", str(perf)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(perf, newline="", encoding="utf-8") as f:
        header, values = list(csv.reader(f))
    row = dict(zip(header, (float(v) for v in values)))
    assert row["Successful requests"] == 4 and row["Failed requests"] == 0, row
    assert 1 <= row["Avg output tokens"] <= 8 and row["Avg input tokens"] > 0, row


def test_benchmark_diff_check_finds_greedy_runs_identical(server, tmp_path):
    """KsanaLLM's --enable_diff_check against the real engine: greedy answers to the same
    prompts, sent one at a time in two runs (the second hitting the prefix cache), are the same."""
    report = tmp_path / "diff.txt"
    cmd = [sys.executable, "-m", "ksana_llm.cli", "bench", "--host", "127.0.0.1",
           "--port", str(server.port), "--backend", "ksana", "--mode", "sync", "--prompt_num", "3",
           "--max_new_tokens", "8", "--enable_diff_check", "--diff_output_file", str(report)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "diff check, run 1 vs run 2: 3/3 answers identical, 0 flagged" in done.stdout
    assert "mean ROUGE-W 1.0000" in report.read_text(encoding="utf-8")
