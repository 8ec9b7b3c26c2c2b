"""The console script end to end: a real process on the default model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ksana_llm.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_generate_answers_a_real_question(default_model_dir):
    proc = _run(["generate", "What is the capital of France?", "--chat", "--max-new-tokens", "20",
                 "--device", "cpu"])
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_streams_and_keeps_history(default_model_dir):
    proc = _run(["chat", "--max-new-tokens", "20", "--device", "cpu"],
                stdin="What is the capital of France?\nAnd of Germany?\n\n")
    assert proc.returncode == 0, proc.stderr
    answers = [line for line in proc.stdout.splitlines() if "assistant>" in line]
    assert len(answers) == 2 and "Paris" in answers[0] and "Berlin" in answers[1]


@pytest.mark.parametrize("args, needle", [
    (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),  # was greedy, silently
    (["generate", "hi", "--temperature", "nan"], "temperature"),
    (["generate", "hi", "--model", "/nonexistent/model"], "/nonexistent/model"),
    # SmolLM2 has no MTP layer to draft with
    (["generate", "hi", "--num-speculative-tokens", "1", "--device", "cpu"],
     "num_speculative_tokens"),
    (["generate", "hi", "--kv-cache-dtype", "int8"], "--kv-cache-dtype"),
    (["serve", "--response-role", " "], "--response-role"),
    (["serve", "--chat-template-content-format", "parts"], "--chat-template-content-format"),
    (["serve", "--endpoint", "trpc"], "--endpoint"),  # KsanaLLM's RPC plugins: not served
    # Refused before the model is looked for (its error would come first otherwise).
    (["serve", "--model", "/nonexistent/model", "--generation-config", "/nonexistent/defaults"],
     "--generation-config: no generation_config.json in /nonexistent/defaults"),
    (["serve", "--model", "/nonexistent/model", "--override-generation-config",
      '{"temperature": -1}'], "--override-generation-config"),
    (["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "/nonexistent/model",
      "--generation-config", "/nonexistent/defaults"], "--generation-config"),
])
def test_bad_arguments_give_a_clear_error(args, needle):
    proc = _run(args)
    assert proc.returncode == 2 and needle in proc.stderr


def test_an_unknown_log_level_is_a_clear_error():
    """KLLM_LOG_LEVEL went to logging as it was: a traceback for every command, --help too."""
    proc = subprocess.run([sys.executable, "-m", "ksana_llm.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KLLM_LOG_LEVEL": "verbose"})
    assert proc.returncode == 2 and "KLLM_LOG_LEVEL must be one of" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_on_a_port_in_use_fails_before_loading_the_model():
    """The socket is bound first (as vLLM does): a port another process holds is a clear error
    at once, not uvicorn's after the model has loaded."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _run(["serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"])
    assert proc.returncode == 2, proc.stderr
    assert f"--port {port}: cannot listen there" in proc.stderr
