"""SIGTERM with requests still running past `--shutdown-timeout`, on a real server process: they
must end cleanly (a 503 with the OpenAI error body, or an error event and [DONE] on a stream),
not as a bare 500 or a stream cut mid-chunk when uvicorn cancels their tasks."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server_process import ServerProcess, openai_error

pytestmark = pytest.mark.timeout(300)

ENDLESS = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def _wait_running(url: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(url + "/v1/stats", timeout=5).json()["num_running"] >= count:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{count} requests never ran")


def test_requests_running_past_the_grace_period_end_with_a_clean_error():
    server = ServerProcess(["--shutdown-timeout", "2"])
    answers: dict[str, object] = {}

    def plain() -> None:
        answers["plain"] = httpx.post(server.base_url + "/completions", timeout=120,
                                      json={"prompt": "Once upon a time", **ENDLESS})

    def streamed() -> None:
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
                "stream": True, **ENDLESS}
        with httpx.stream("POST", server.base_url + "/chat/completions", json=body,
                          timeout=120) as response:
            answers["stream_status"] = response.status_code
            answers["stream"] = [line for line in response.iter_lines() if line]

    try:
        clients = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for client in clients:
            client.start()
        _wait_running(server.url, 2)
        server.proc.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        for client in clients:
            client.join(60)
        # uvicorn re-raises the signal once it has stopped, as a process killed by it.
        assert server.proc.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - stopping < 20
    finally:
        server.stop()
    response = answers["plain"]
    assert response.status_code == 503 and "shut down" in openai_error(response)["message"]
    lines = answers["stream"]
    assert answers["stream_status"] == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert "shut down" in error["message"]
