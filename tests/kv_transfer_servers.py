"""The servers of a disaggregated deployment, as module fixtures: a real prefill server (vLLM's
`serve --kv-transfer-config '{"kv_role": "kv_producer", ...}'`, i.e. `--kv-role prefill`), a real
decode server (`serve --kv-role decode`, another block size) and `ksana-llm router` in front,
with the official `openai` client on the router; and what their tests read from them. Imported
by tests/test_kv_transfer_server.py and tests/test_router_failures.py (each module starts its
own servers)."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

import ksana_llm as kt
from tests.server_process import ServerProcess

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


@pytest.fixture(scope="module")
def prefill(default_model_dir):
    # vLLM's spelling of --kv-role prefill (the decode server below uses ours).
    proc = ServerProcess(["--kv-transfer-config",
                          '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}',
                          "--num-device-blocks", "128"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def decode(default_model_dir):
    proc = ServerProcess(["--kv-role", "decode", "--num-device-blocks", "192",
                          "--block-token-num", "8"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def router(prefill, decode):
    proc = ServerProcess(["--prefill", prefill.url, "--decode", decode.url], command="router")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=60)


def metric_total(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^ksana_llm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["message"]
    return body["error"]


def chat_prompt_ids(local_engine: kt.Engine, messages: list[dict]) -> list[int]:
    tok = local_engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)
