"""More of vLLM's deployment flags: those that describe what this engine does anyway (or ask for
nothing it has) are taken with a warning saying why, and values that ask for what it does not
do stop the command line with the reason."""

from __future__ import annotations

import pytest

from ksana_llm.cli import build_parser
from ksana_llm.server.app import configs_from_args


def test_flags_taken_with_a_warning(caplog):
    flags = ["--api-server-count", "4", "--limit-mm-per-prompt", '{"image": 2}',
             "--model-impl", "auto", "--config-format", "hf", "--safetensors-load-strategy",
             "lazy", "--code-revision", "main", "--enable-eplb", "--enable-reasoning"]
    with caplog.at_level("WARNING", logger="ksana_llm.cli"):
        args = build_parser().parse_args(["serve", "/models/m", *flags])
    warned = {r.getMessage().split(" changes nothing")[0] for r in caplog.records}
    assert warned == {f for f in flags if f.startswith("--")}
    assert configs_from_args(args)[0].model == "/models/m"


@pytest.mark.parametrize("flags, reason", [
    (["--model-impl", "transformers"], "accepted: auto, vllm"),
    (["--config-format", "mistral"], "accepted: auto, hf"),
])
def test_values_asking_for_what_is_not_here_are_refused(flags, reason, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])
    assert reason in capsys.readouterr().err
