"""`serve --data-parallel-size 2` (vLLM's): two replicas (each a real `serve` process) behind one
endpoint. Answers are transformers' greedy tokens, requests reach both replicas, stopping the
server stops them, a replica that dies stops the server, and settings it cannot take are
refused before anything starts."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest
from transformers import AutoTokenizer

from ksana_llm.cli import main
from ksana_llm.server.data_parallel import replica_command
from tests.family_harness import greedy_trace, hf_reference
from tests.lora_adapters import ALL_TARGETS, write_adapter_files
from tests.server_process import ServerProcess
from tests.tiny_models import build_tiny_chat_model

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(default_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("data-parallel") / "tiny"
    hf = build_tiny_chat_model(folder, default_model_dir, num_hidden_layers=2)
    write_adapter_files(hf, folder.parent / "adapter", seed=1, targets=ALL_TARGETS, rank=4)
    return folder, hf_reference(hf), AutoTokenizer.from_pretrained(default_model_dir)


def _replicas(server: ServerProcess) -> list[tuple[str, int]]:
    """(URL, pid) of each replica, from the server's log."""
    return [(url, int(pid)) for url, pid in re.findall(
        r"data-parallel replica \d+: (http://127\.0\.0\.1:\d+) \(pid (\d+)\)", server.log())]


def _successes(url: str, server: str | None = None) -> float:
    """Finished requests in `url`'s /metrics (only the samples of `server`, on a front end)."""
    metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer secret"},
                        timeout=10).text
    assert "ksana_llm:request_success_total" in metrics
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("ksana_llm:request_success_total{")
               and (server is None or f'server="{server}"' in line))


def test_two_replicas_behind_one_endpoint(tiny):
    folder, reference, tokenizer = tiny
    ids = tokenizer(PROMPT)["input_ids"]
    expected = tokenizer.decode(greedy_trace(reference, ids, MAX_TOKENS)[0][len(ids):])
    server = ServerProcess(["--model", str(folder), "--served-model-name", "tiny", "--dtype",
                            "float32", "--data-parallel-size", "2", "--api-key", "secret",
                            "--root-path", "/api", "--allow-runtime-lora-updating"])
    try:
        replicas = [url for url, _ in _replicas(server)]
        assert len(set(replicas)) == 2
        # --root-path (a proxy strips its prefix): probes stay open without the key, and what
        # the front end passes on reaches the replicas' routes, which have no prefix.
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        headers = {"Authorization": "Bearer secret"}
        for _ in range(4):
            answer = httpx.post(server.base_url + "/completions", json=body, headers=headers,
                                timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected
        assert httpx.post(server.base_url + "/completions", json=body,
                          timeout=60).status_code == 401
        # Both replicas answered (in turn), and each keeps the key; the front end's /metrics
        # has each one's, labelled with its URL.
        assert [_successes(url) for url in replicas] == [2, 2]
        assert [_successes(server.url, url) for url in replicas] == [2, 2]
        front = httpx.get(server.url + "/metrics", timeout=10).text  # open, for Prometheus
        assert "ksana_llm:router_unreachable_servers 0.0" in front
        # vLLM's /load for load balancers, and /v1/stats: every replica's, by URL (were 404).
        load = httpx.get(server.url + "/load", headers=headers, timeout=10)
        assert load.status_code == 200, load.text
        assert load.json() == {"server_load": 0, "servers": {url: 0 for url in replicas}}
        models = httpx.get(server.url + "/v1/models", headers=headers, timeout=10)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny", models.text
        tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=headers,
                            timeout=10)
        assert tokens.status_code == 200 and tokens.json()["tokens"] == ids, tokens.text
        reset = httpx.post(server.url + "/reset_prefix_cache", headers=headers, timeout=10)
        assert reset.status_code == 200, reset.text
        stats = httpx.get(server.url + "/v1/stats", headers=headers, timeout=10)
        assert stats.status_code == 200, stats.text
        assert set(stats.json()["servers"]) == set(replicas)
        assert all(s["num_free_kv_blocks"] == s["num_kv_blocks"]
                   for s in stats.json()["servers"].values())
        assert httpx.post(replicas[0] + "/v1/completions", json=body,
                          timeout=60).status_code == 401
        # Runtime LoRA loading reaches every replica: each answers for the adapter alike.
        adapter = {"lora_name": "tone", "lora_path": str(folder.parent / "adapter")}
        loaded = httpx.post(server.url + "/v1/load_lora_adapter", json=adapter,
                            headers=headers, timeout=60)
        assert loaded.status_code == 200 and loaded.json() == {
            "servers": {url: {} for url in replicas}}, loaded.text
        texts = set()
        for _ in range(2):
            answer = httpx.post(server.base_url + "/completions", json={**body, "model": "tone"},
                                headers=headers, timeout=60)
            assert answer.status_code == 200, answer.text
            texts.add(answer.json()["choices"][0]["text"])
        assert len(texts) == 1
        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "tone"},
                          headers=headers, timeout=60).status_code == 200
        assert httpx.post(server.base_url + "/completions", json={**body, "model": "tone"},
                          headers=headers, timeout=60).status_code == 404
    finally:
        server.stop()
    for url in replicas:
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)


def test_a_dead_replica_stops_the_server(tiny):
    folder = tiny[0]
    server = ServerProcess(["--model", str(folder), "--dtype", "float32",
                            "--data-parallel-size", "2"])
    try:
        (first, _), (_, second_pid) = _replicas(server)
        os.kill(second_pid, signal.SIGKILL)
        assert server.proc.wait(60) == 1
        with pytest.raises(httpx.HTTPError):
            httpx.get(first + "/health", timeout=2)
    finally:
        server.stop()


def test_refusals_and_the_replica_command(capsys):
    assert main(["serve", "--data-parallel-size", "2", "--kv-role", "prefill",
                 "--device", "cpu"]) == 2
    assert "start the prefill and decode servers yourself" in capsys.readouterr().err
    assert main(["serve", "--data-parallel-size", "2", "--tensor-parallel-size", "0",
                 "--device", "cpu"]) == 2
    assert "explicit --tensor-parallel-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--data-parallel-size", "0"])
    command = replica_command(["serve", "m", "--ssl-certfile", "c.pem", "--ssl-keyfile=k.pem",
                               "--root-path", "/api", "--api-key", "k", "-dp", "2"], 9000)
    assert command[3:] == ["serve", "m", "--api-key", "k", "-dp", "2", "--data-parallel-size",
                           "1", "--host", "127.0.0.1", "--port", "9000"]
