"""HTTPS (vLLM's --ssl-certfile / --ssl-keyfile) on a real server process, started the vLLM way
(`serve MODEL`), called by the official `openai` client that trusts only a throwaway CA, with
--access-log and --root-path on; and certificate mistakes refused at once, before the model loads, naming the
flag."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest
import trustme

from tests.server_process import ServerProcess

PASSWORD = "correct horse"


@pytest.fixture(scope="module")
def authority():
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_files(authority, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    cert = authority.issue_cert("127.0.0.1")
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    return cert_file, key_file


@pytest.fixture(scope="module")
def encrypted_key(tls_files):
    """The same key, encrypted with PASSWORD."""
    from cryptography.hazmat.primitives import serialization

    _, key_file = tls_files
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    encrypted = key_file.with_name("encrypted-key.pem")
    encrypted.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(PASSWORD.encode())))
    return encrypted


def test_https_server_answers_the_openai_client(authority, tls_files, encrypted_key,
                                                default_model_dir):
    cert_file, _ = tls_files
    trusting = ssl.create_default_context()
    authority.configure_trust(trusting)
    server = ServerProcess([str(default_model_dir), "--num-device-blocks", "64",
                            "--max-model-len", "256", "--ssl-certfile", str(cert_file),
                            "--ssl_keyfile", str(encrypted_key),  # KsanaLLM's spelling
                            "--ssl-keyfile-password", PASSWORD,
                            "--access-log", "--root_path", "/llm", "--api-key", "k",
                            "--endpoint", "python"], tls_context=trusting)  # KsanaLLM's flag
    try:
        assert server.url.startswith("https://")
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0,
                               timeout=120, http_client=httpx.Client(verify=trusting))
        answer = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in answer.choices[0].message.content
        # Plain HTTP on the TLS port is not served; a client without the CA refuses the cert.
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(server.url + "/health", timeout=10)
        # --root-path: the proxy strips its prefix, so the routes stay where they are; the
        # prefix shows in the URLs the server gives out (its API description). The probes stay
        # open without the key (the readiness wait above got /health without it).
        key = {"Authorization": "Bearer k"}
        assert httpx.get(server.url + "/v1/models", verify=trusting, headers=key,
                         timeout=10).status_code == 200
        assert httpx.get(server.url + "/v1/models", verify=trusting,
                         timeout=10).status_code == 401
        assert httpx.get(server.url + "/ping", verify=trusting, timeout=10).status_code == 200
        described = httpx.get(server.url + "/openapi.json", verify=trusting, headers=key,
                              timeout=10).json()
        assert described["servers"] == [{"url": "/llm"}]
        # Ready: said once it listens, though --log-level stays at warning.
        assert f"on https://127.0.0.1:{server.port} (Ctrl-C to stop)" in server.log()
        # --access-log: every request logged, though --log-level stays at warning.
        assert '/v1/chat/completions HTTP/1.1" 200' in server.log()
    finally:
        server.stop()


def _serve(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ksana_llm.cli", "serve", "--device", "cpu",
                           *args], capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start


def test_certificate_mistakes_fail_before_the_model_loads(tls_files, encrypted_key, tmp_path):
    cert_file, key_file = tls_files
    other_key = tmp_path / "other.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    for args, needle in (
            (["--ssl-keyfile", str(key_file)], "--ssl-keyfile and --ssl-keyfile-password need --ssl-certfile"),
            (["--ssl-certfile", str(tmp_path / "missing.pem")],
             f"--ssl-certfile {tmp_path / 'missing.pem'}: cannot load the certificate and key"),
            # the certificate alone: its key is not in the file
            (["--ssl-certfile", str(cert_file)], "cannot load the certificate and key"),
            # a key that is not the certificate's
            (["--ssl-certfile", str(cert_file), "--ssl-keyfile", str(other_key)],
             "cannot load the certificate and key"),
            # an encrypted key: refused without its password (OpenSSL never asks on a
            # terminal), and with a wrong one
            (["--ssl-certfile", str(cert_file), "--ssl-keyfile", str(encrypted_key)],
             "an encrypted key needs --ssl-keyfile-password"),
            (["--ssl-certfile", str(cert_file), "--ssl-keyfile", str(encrypted_key),
              "--ssl-keyfile-password", "wrong"], "cannot load the certificate and key")):
        proc, took = _serve("--model", "/nonexistent/model", *args)
        # The model path is bad too: only an error about TLS proves TLS is checked first.
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)
        assert "/nonexistent/model" not in proc.stderr


def test_router_serves_https_too(authority, tls_files, tmp_path):
    """`router` takes the same flags: with no decode server up its /health is a 503, over TLS."""
    from tests.server_process import free_port

    cert_file, key_file = tls_files
    trusting = ssl.create_default_context()
    authority.configure_trust(trusting)
    port = free_port()
    with (tmp_path / "router.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ksana_llm.cli", "router", "--port",
                                 str(port), "--decode", "http://127.0.0.1:9", "--ssl-certfile",
                                 str(cert_file), "--ssl-keyfile", str(key_file)],
                                stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline, answer = time.monotonic() + 60, None
        while answer is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                answer = httpx.get(f"https://127.0.0.1:{port}/health", verify=trusting, timeout=10)
            except httpx.TransportError:  # not listening yet, or slow to start TLS
                time.sleep(0.3)
        assert answer is not None, "the router never answered over HTTPS"
        assert answer.status_code == 503 and answer.json()["servers"] == {"http://127.0.0.1:9": None}
        assert (f"ksana-llm: routing to 0 prefill and 1 decode servers on https://127.0.0.1:{port}"
                in (tmp_path / "router.log").read_text())
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
