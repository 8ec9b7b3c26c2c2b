"""The console script end to end: a real process on the default model."""

from __future__ import annotations

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
    (["generate", "hi", "--model", "/nonexistent/model"], "/nonexistent/model"),
])
def test_bad_arguments_give_a_clear_error(args, needle):
    proc = _run(args)
    assert proc.returncode == 2 and needle in proc.stderr
