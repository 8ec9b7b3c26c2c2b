"""`ksana-llm run-batch` as a real subprocess on the default model: an OpenAI batch file with
chat, completions, embeddings, Responses, score and rerank requests, and lines that are not requests. Answers
equal the Python API's (whose greedy tokens equal transformers', tests/test_engine_greedy_parity.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ksana_llm as kt

QUESTION = "What is the capital of France?"
PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


def test_a_batch_file_is_answered_line_by_line(tmp_path, local_engine):
    chat = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": 16}
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "temperature": 0, "max_tokens": 8}},
        {"custom_id": "embedding", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": PROMPT}},
        {"custom_id": "response", "method": "POST", "url": "/v1/responses",
         "body": {"input": QUESTION, "temperature": 0, "max_output_tokens": 16}},
        {"custom_id": "bad-param", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "temperature": -1}},
        {"custom_id": "streamed", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "stream": True}},
        {"custom_id": "elsewhere", "method": "POST", "url": "/v1/images", "body": {}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/completions", "body": {}},
        # A raw line separator inside a string is still one JSON line.
        {"custom_id": "separator", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "one\u2028two", "max_tokens": 1}},
        {"custom_id": "score", "method": "POST", "url": "/v1/score",
         "body": {"text_1": QUESTION, "text_2": [PROMPT, QUESTION]}},
        {"custom_id": "rerank", "method": "POST", "url": "/v1/rerank",
         "body": {"query": QUESTION, "documents": [PROMPT, QUESTION]}},
        # Its answer would come after the batch ends (once "in_progress", then lost).
        {"custom_id": "background", "method": "POST", "url": "/v1/responses",
         "body": {"input": QUESTION, "max_output_tokens": 4, "background": True}},
    ]
    source = tmp_path / "in.jsonl"
    # Saved with a byte-order mark, as Windows editors do: the first line is read all the same.
    source.write_text("\n".join([json.dumps(line, ensure_ascii=False) for line in lines]
                                + ["{not json"]) + "\n", encoding="utf-8-sig")
    target = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "ksana_llm.cli", "run-batch", "-i", str(source),
                           "-o", str(target), "--device", "cpu", "--num-device-blocks", "256",
                           "--no-progress"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = [json.loads(line) for line in target.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == [line["custom_id"] for line in lines] + [None]
    assert outputs[7]["error"]["code"] == "duplicate_custom_id"
    by_id = {o["custom_id"]: o for o in outputs[:7] + outputs[8:]}
    assert by_id["separator"]["response"]["status_code"] == 200

    tok = local_engine.tokenizer
    rendered = tok.apply_chat_template(chat["messages"], add_generation_prompt=True,
                                       tokenize=False)
    expected = local_engine.generate_outputs(rendered, kt.GenerationConfig(max_new_tokens=16),
                                             use_tqdm=False)[0].text
    answer = by_id["chat"]["response"]
    assert answer["status_code"] == 200 and answer["request_id"].startswith("chatcmpl-")
    assert answer["body"]["choices"][0]["message"]["content"] == expected
    response = by_id["response"]["response"]["body"]
    assert response["output"][0]["content"][0]["text"] == expected  # the same conversation
    completion = by_id["completion"]["response"]["body"]["choices"][0]["text"]
    assert completion == local_engine.generate_outputs(
        PROMPT, kt.GenerationConfig(max_new_tokens=8), use_tqdm=False)[0].text
    vector = torch.tensor(by_id["embedding"]["response"]["body"]["data"][0]["embedding"])
    torch.testing.assert_close(vector, local_engine.embed(PROMPT)[0], atol=1e-5, rtol=1e-4)
    scores = [d["score"] for d in by_id["score"]["response"]["body"]["data"]]
    assert scores == pytest.approx(local_engine.score(QUESTION, [PROMPT, QUESTION]), abs=1e-5)
    ranked = by_id["rerank"]["response"]["body"]["results"]
    assert [r["index"] for r in ranked] == [1, 0] and ranked[0]["relevance_score"] == \
        pytest.approx(scores[1], abs=1e-5)

    refused = by_id["bad-param"]
    assert refused["response"]["status_code"] == 400 and refused["error"] is None
    assert refused["response"]["body"]["error"]["param"] == "temperature"
    # Every response names its request (OpenAI's batch output does), errors and embeddings too.
    assert all(o["response"]["request_id"] for o in outputs if o["response"] is not None)
    for custom_id, code in (("streamed", "invalid_request"), ("elsewhere", "invalid_url"),
                            ("background", "invalid_request"), (None, "invalid_json")):
        assert by_id[custom_id]["response"] is None
        assert by_id[custom_id]["error"]["code"] == code


def test_the_files_may_come_from_the_config_file_and_must_be_local_paths(tmp_path):
    """vLLM's --config gives any flag, the required ones too; `-` and URLs are refused by name
    (not a file literally named "-", nor a mangled path), before the model loads."""
    source = tmp_path / "batch.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": {"prompt": PROMPT, "max_tokens": 1}}) + "\n")
    config = tmp_path / "batch.yaml"
    config.write_text(f"input-file: {source}\noutput-file: {tmp_path / 'out.jsonl'}\n"
                      "no-progress: true\nnum-device-blocks: 32\n")
    done = subprocess.run([sys.executable, "-m", "ksana_llm.cli", "run-batch", "--config",
                           str(config), "--device", "cpu"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "out.jsonl").read_text())["response"]["status_code"] == 200
    for flags, message in ((["-i", str(source), "-o", "-"], "--output-file must be a local"),
                           (["-i", "http://host/batch.jsonl", "-o", "x"], "--input-file must be"),
                           (["-i", str(source)], "--output-file is required")):
        refused = subprocess.run([sys.executable, "-m", "ksana_llm.cli", "run-batch", *flags],
                                 capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "-").exists()


def test_the_output_file_may_not_be_the_input_file(tmp_path):
    """Opening the output empties it: the requests would be gone before a single answer."""
    source = tmp_path / "batch.jsonl"
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": PROMPT, "max_tokens": 1}}
    source.write_text(json.dumps(line) + "\n", encoding="utf-8")
    same = tmp_path / "." / "batch.jsonl"  # spelled differently, the same file
    done = subprocess.run([sys.executable, "-m", "ksana_llm.cli", "run-batch", "-i", str(source),
                           "-o", str(same), "--device", "cpu"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "is the input file" in done.stderr, done.stderr[-2000:]
    assert json.loads(source.read_text(encoding="utf-8")) == line


def test_a_line_with_a_lone_surrogate_is_invalid_json():
    """Not text (an unpaired \\ud800 escape): the line's own error, as a server body's 400; a
    well-formed pair is one character."""
    from ksana_llm.server.batch_runner import parse_line

    line = '{"custom_id": "s", "method": "POST", "url": "/v1/completions", "body": {"prompt": "%s"}}'
    request, error = parse_line(line % "x\\ud800", set())
    assert request is None and error["error"]["code"] == "invalid_json"
    assert "surrogate" in error["error"]["message"]
    request, error = parse_line(line % "x\\ud83d\\ude00", set())
    assert error is None and request["body"]["prompt"] == "x\U0001F600"
