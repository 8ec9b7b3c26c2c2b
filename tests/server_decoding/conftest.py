"""The servers the decoding tests talk to: a real `ksana-llm serve` process on SmolLM2 with
`--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3 --max-logprobs 8`
and a chat template that shows the tools, `enable_thinking` and `reasoning_effort` it is given
(harness.TEMPLATE); and, in-process on the session's model (no second model load), an app with
the deepseek_r1 reasoning parser and no tool parser. Module-scoped: each test module gets its own."""

from __future__ import annotations

import pytest

import ksana_llm as kt
from tests.server_decoding.harness import KV_ARGS, TEMPLATE
from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(default_model_dir, template_file):
    proc = ServerProcess([*KV_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                          "--reasoning-parser", "qwen3", "--chat-template", str(template_file),
                          "--max-logprobs", "8"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def r1_app(default_model):
    """A second server, in-process (it shares the test session's model instead of loading one):
    `--reasoning-parser deepseek_r1`, no tool parser."""
    from ksana_llm.server.app import build_app
    from ksana_llm.server.serve_options import OutputParsing

    engine = kt.Engine(default_model, num_device_blocks=128)
    yield build_app(engine, served_model_name="r1", parsing=OutputParsing(reasoning_parser="deepseek_r1"))
    engine.shutdown()


@pytest.fixture(scope="module")
def model(model_name):
    """The served model's name (the root conftest's `client` talks to this directory's server)."""
    return model_name
