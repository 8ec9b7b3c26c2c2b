"""A real `ksana-llm serve` subprocess on 127.0.0.1 for server tests."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def stub_http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 answering with `handler`, on a thread; yields its URL.
    For what a test must see from the other side of a connection (what a client sends, answers
    no server of ours would give)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class ServerProcess:
    """`python -m ksana_llm.cli serve ...` (or `router ...`) on a free port; `stop()` always
    ends it."""

    def __init__(self, extra_args: Sequence[str] = (), ready_timeout: float = 180.0,
                 env: Mapping[str, str] | None = None, command: str = "serve",
                 tls_context: ssl.SSLContext | None = None) -> None:
        """`tls_context`: the server serves HTTPS (--ssl-certfile in `extra_args`), and this
        context trusts its certificate."""
        self.port = free_port()
        self.url = f"{'https' if tls_context else 'http'}://127.0.0.1:{self.port}"
        self._verify: ssl.SSLContext | bool = tls_context or True
        self._log = tempfile.NamedTemporaryFile("w+", prefix="ksana-server-", suffix=".log",
                                                delete=False)
        device = ["--device", "cpu"] if command == "serve" else []
        cmd = [sys.executable, "-m", "ksana_llm.cli", command, "--host", "127.0.0.1",
               "--port", str(self.port), *device, *extra_args]
        env = {**os.environ, "TQDM_DISABLE": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        self._log.flush()
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2, verify=self._verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        os.unlink(self._log.name)


def openai_error(response: httpx.Response) -> dict:
    """The `error` object of an OpenAI-style error body, checked: exactly its four fields, and a
    message."""
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def server_fixture(args: Sequence[str]):
    """A module-scoped `server` fixture: `ksana-llm serve` with `args` on the default model
    (a ServerProcess), stopped once the module's tests are done."""
    @pytest.fixture(scope="module")
    def server(default_model_dir):
        proc = ServerProcess(list(args))
        yield proc
        proc.stop()

    return server
