"""Parallel runs behind the real server: TP 2 driven by the `openai` client, and two "nodes" on
loopback started the KsanaLLM way (WORLD_SIZE=2, NODE_RANK 0 and 1, MASTER_HOST, MASTER_PORT),
where killing the worker node makes the master fail fast and exit non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.family_harness import greedy_trace, hf_reference
from tests.server_process import ServerProcess, free_port
from tests.tiny_models import build_tiny_chat_model

pytestmark = pytest.mark.timeout(400)

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_chat_model(default_model_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (the server needs one): 4 heads, 2 KV heads,
    3 layers, so it splits over 2 ranks (TP) and 2 stages (PP)."""
    folder = tmp_path_factory.mktemp("tiny-chat")
    hf = build_tiny_chat_model(folder, default_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(PROMPT)["input_ids"]
    expected = greedy_trace(hf_reference(hf), ids, MAX_TOKENS)[0][len(ids):]
    return folder, tokenizer.decode(expected)


def completion(base_url: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True})
    return result.choices[0].text


def test_tensor_parallel_server_answers_like_transformers(tiny_chat_model):
    folder, expected = tiny_chat_model
    server = ServerProcess(["--model", str(folder), "--served-model-name", "tiny",
                            "--tensor-parallel-size", "2", "--dtype", "float32"])
    try:
        assert completion(server.base_url) == expected
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected
    finally:
        server.stop()


def test_two_nodes_on_loopback_serve_and_fail_fast(tiny_chat_model, tmp_path):
    folder, expected = tiny_chat_model
    master_port = str(free_port())
    common = {"WORLD_SIZE": "2", "MASTER_HOST": "127.0.0.1", "MASTER_PORT": master_port,
              "TQDM_DISABLE": "1"}
    worker_log = open(tmp_path / "node1.log", "w+")
    worker = subprocess.Popen(
        [sys.executable, "-m", "ksana_llm.cli", "serve", "--model", str(folder), "--device", "cpu",
         "--dtype", "float32"], env={**os.environ, **common, "NODE_RANK": "1"},
        stdout=worker_log, stderr=subprocess.STDOUT)
    master = None
    try:
        master = ServerProcess(["--model", str(folder), "--served-model-name", "tiny",
                                "--dtype", "float32"], env={**common, "NODE_RANK": "0"})
        assert completion(master.base_url) == expected  # layers split over the two nodes
        worker.kill()
        worker.wait(10)
        start = time.monotonic()
        response = httpx.post(master.url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
        assert response.status_code == 503, response.text
        assert time.monotonic() - start < 30
        master.proc.wait(30)  # the master exits by itself ...
        assert master.proc.returncode != 0  # ... with a failure code
        assert "worker" in master.log().lower()
    finally:
        if worker.poll() is None:
            worker.kill()
        worker_log.close()
        if master is not None:
            master.stop()
