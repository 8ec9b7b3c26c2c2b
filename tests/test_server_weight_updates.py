"""The RL trainer's routes on a real server: POST /update_weights_from_disk
(`serve --enable-weight-updates`): after it, the official client's greedy completions are those
of transformers on the new checkpoint; a folder that does not fit is a 400 with the OpenAI error
body and the server answers as before. /sleep, /wake_up and /is_sleeping (`--enable-sleep-mode`):
a completion sent while the server sleeps is answered after it wakes. Without the flags the
routes do not exist."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.family_harness import greedy_trace, hf_reference
from tests.server_process import ServerProcess
from tests.tiny_models import build_tiny_chat_model, build_tiny_model

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(default_model_dir, tmp_path_factory) -> dict:
    """Two tiny chat Llamas of one shape (seeds 0 and 1) and transformers' greedy text of each."""
    root = tmp_path_factory.mktemp("server-weights")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    found = {}
    for name, seed in (("a", 0), ("b", 1)):
        hf = build_tiny_chat_model(root / name, default_model_dir, num_hidden_layers=2, seed=seed)
        found[name] = root / name
        found["text_" + name] = tokenizer.decode(
            greedy_trace(hf_reference(hf), ids, MAX_TOKENS)[0][len(ids):])
    assert found["text_a"] != found["text_b"]
    return found


def completion(client: openai.OpenAI) -> str:
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body={"ignore_eos": True}
                                     ).choices[0].text


def test_update_weights_from_disk(checkpoints, tmp_path):
    server = ServerProcess(["--model", str(checkpoints["a"]), "--served-model-name", "tiny",
                            "--dtype", "float32", "--enable-weight-updates"])
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)
        assert completion(client) == checkpoints["text_a"]
        route = server.url + "/update_weights_from_disk"
        for body, param in (({"model_path": str(tmp_path / "missing")}, "model_path"),
                            ({"model_path": str(checkpoints["a"]), "flush": 1}, "flush"),
                            ({}, "model_path")):
            answer = httpx.post(route, json=body, timeout=60)
            assert answer.status_code == 400, body
            assert answer.json()["error"]["param"] == param, answer.json()
        other = tmp_path / "moe"
        build_tiny_model("qwen3-moe", other)
        answer = httpx.post(route, json={"model_path": str(other)}, timeout=60)
        assert answer.status_code == 400 and "qwen3_moe" in answer.json()["error"]["message"]
        assert completion(client) == checkpoints["text_a"]

        answer = httpx.post(route, json={"model_path": str(checkpoints["b"])}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["success"] is True and answer.json()["num_tensors"] > 0
        assert completion(client) == checkpoints["text_b"]
    finally:
        server.stop()


def test_sleep_and_wake_up(checkpoints):
    """vLLM's trainer loop over HTTP: sleep at level 2, wake the weights, load new ones, wake
    the KV cache; a completion sent meanwhile waits and is answered from the new weights. The
    loop's calls go through a router in front of the server, which passes them on (and asks
    the server whether it sleeps)."""
    server = ServerProcess(["--model", str(checkpoints["a"]), "--served-model-name", "tiny",
                            "--dtype", "float32", "--enable-weight-updates",
                            "--enable-sleep-mode"])
    router = None
    try:
        router = ServerProcess(["--prefill", server.url, "--decode", server.url],
                               command="router")
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)

        def asleep() -> bool:
            direct = httpx.get(server.url + "/is_sleeping").json()["is_sleeping"]
            routed = httpx.get(router.url + "/is_sleeping")
            assert routed.status_code == 200
            assert routed.json() == {"is_sleeping": direct, "servers": {server.url: direct}}
            return direct

        assert completion(client) == checkpoints["text_a"] and asleep() is False
        for query, param in (("level=3", "level"), ("level=x", "level")):
            answer = httpx.post(server.url + "/sleep?" + query)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param
        answer = httpx.post(server.url + "/wake_up?tags=gpu")
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "tags"

        assert httpx.post(router.url + "/sleep?level=2").status_code == 200
        assert asleep() is True
        answers: list[str] = []
        waiting = threading.Thread(target=lambda: answers.append(completion(client)))
        waiting.start()
        waiting.join(timeout=2)
        assert waiting.is_alive()  # queued while the server sleeps
        assert httpx.post(router.url + "/wake_up?tags=weights").status_code == 200
        assert asleep() is True
        answer = httpx.post(router.url + "/update_weights_from_disk", timeout=120,
                            json={"model_path": str(checkpoints["b"])})
        assert answer.status_code == 200, answer.text
        assert httpx.post(router.url + "/wake_up?tags=kv_cache").status_code == 200
        waiting.join(timeout=60)
        assert answers == [checkpoints["text_b"]] and asleep() is False
    finally:
        if router is not None:
            router.stop()
        server.stop()


def test_the_routes_need_their_flags(checkpoints):
    server = ServerProcess(["--model", str(checkpoints["a"]), "--served-model-name", "tiny",
                            "--dtype", "float32"])
    try:
        for route in ("/update_weights_from_disk", "/sleep", "/wake_up"):
            answer = httpx.post(server.url + route, json={"model_path": str(checkpoints["b"])},
                                timeout=60)
            assert answer.status_code == 404, route
        assert httpx.get(server.url + "/is_sleeping").status_code == 404
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)
        assert completion(client) == checkpoints["text_a"]
    finally:
        server.stop()
