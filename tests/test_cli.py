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
    # SmolLM2 has no MTP layer to draft with
    (["generate", "hi", "--num-speculative-tokens", "1", "--device", "cpu"],
     "num_speculative_tokens"),
])
def test_bad_arguments_give_a_clear_error(args, needle):
    proc = _run(args)
    assert proc.returncode == 2 and needle in proc.stderr


def test_serve_step_loop_flags_reach_the_engine_config(tmp_path):
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import engine_config_from_args

    parse = build_parser().parse_args
    config = engine_config_from_args(parse(["serve"]))
    assert (config.enable_cuda_graphs, config.async_scheduling,
            config.overlap_output_processing) == (True, None, None)  # the device decides
    args = ["serve", "--no-enable-cuda-graphs", "--no-async-scheduling",
            "--overlap-output-processing"]
    config = engine_config_from_args(parse(args))
    assert (config.enable_cuda_graphs, config.async_scheduling,
            config.overlap_output_processing) == (False, False, True)
    yaml_file = tmp_path / "ksana.yaml"
    yaml_file.write_text("setting:\n  global:\n    enable_cuda_graph: true\n")
    config = engine_config_from_args(parse([*args, "--config_file", str(yaml_file)]))
    assert (config.enable_cuda_graphs, config.async_scheduling) == (False, False)  # flags win
    assert engine_config_from_args(parse(["serve"])).num_speculative_tokens == 0
    config = engine_config_from_args(parse(["serve", "--num-speculative-tokens", "2"]))
    assert config.num_speculative_tokens == 2
