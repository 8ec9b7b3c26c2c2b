"""Sampling defaults from the model's generation_config.json (vLLM's `--generation-config` and
`--override-generation-config`): what is read, what is refused, and a real server whose model
folder asks for greedy decoding and short answers serving requests that leave those out."""

from __future__ import annotations

import json

import openai
import pytest

from ksana_llm.server.sampling_defaults import SamplingDefaults, load_sampling_defaults
from tests.server_process import ServerProcess

QWEN3_LIKE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
              "repetition_penalty": 1.0, "bos_token_id": 1, "max_new_tokens": 300}


def _folder(tmp_path, values):
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return tmp_path


def test_the_model_folder_gives_the_defaults(tmp_path):
    folder = _folder(tmp_path, QWEN3_LIKE)
    # repetition_penalty 1.0 is transformers' own default: not a choice, not a default.
    assert load_sampling_defaults("auto", folder) == SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20, max_tokens=300)
    assert load_sampling_defaults("vllm", folder) == SamplingDefaults()
    assert load_sampling_defaults(str(folder), None).top_k == 20  # another folder, by path
    assert load_sampling_defaults("auto", tmp_path / "none") == SamplingDefaults()  # no file
    overridden = load_sampling_defaults("auto", folder, {"temperature": 0, "min_p": 0.1})
    assert (overridden.temperature, overridden.min_p, overridden.top_k) == (0, 0.1, 20)


@pytest.mark.parametrize("source, values, overrides, message", [
    ("auto", {"temperature": -1}, None, "temperature"),
    ("auto", {"top_p": 0}, None, "top_p"),
    ("auto", {"top_k": 2.5}, None, "top_k"),
    ("auto", {"max_new_tokens": 0}, None, "max_new_tokens"),
    ("auto", {}, {"temprature": 0.5}, "temprature"),
    ("auto", {}, {"repetition_penalty": "high"}, "repetition_penalty"),
    ("missing", {}, None, "generation_config.json"),
])
def test_bad_defaults_name_the_key(tmp_path, source, values, overrides, message):
    folder = _folder(tmp_path, values)
    with pytest.raises(ValueError, match=message):
        load_sampling_defaults(str(tmp_path / source) if source == "missing" else source,
                               folder, overrides)


def test_cli_flags():
    from ksana_llm.cli import build_parser

    parse = build_parser().parse_args
    args = parse(["serve", "--generation-config", "vllm", "--override-generation-config",
                  '{"temperature": 0.2}'])
    assert (args.generation_config, args.override_generation_config) == \
        ("vllm", {"temperature": 0.2})
    assert parse(["serve"]).generation_config == "auto"
    with pytest.raises(SystemExit):
        parse(["serve", "--override-generation-config", "[1]"])


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    """The default model in a folder whose generation_config.json asks for greedy decoding and
    at most 6 new tokens; --override-generation-config lowers that to 5."""
    folder = tmp_path_factory.mktemp("model") / "SmolLM2-greedy"
    folder.mkdir()
    for path in default_model_dir.iterdir():
        if path.name != "generation_config.json":
            (folder / path.name).symlink_to(path)
    _folder(folder, {"temperature": 0.0, "max_new_tokens": 6, "eos_token_id": 2})
    proc = ServerProcess(["--model", str(folder), "--num-device-blocks", "128",
                          "--override-generation-config", '{"max_new_tokens": 5}'])
    yield proc
    proc.stop()


def test_requests_that_leave_parameters_out_get_the_models(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Write a long story about a dragon."}]
    reply = client.chat.completions.create(model=model, messages=messages, n=3)
    texts = [c.message.content for c in reply.choices]
    # Greedy (the folder's temperature 0): three equal choices, the greedy answer's first tokens.
    greedy = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                            max_tokens=5)
    assert texts == [greedy.choices[0].message.content] * 3
    assert reply.usage.completion_tokens == 3 * 5  # the override's max_new_tokens
    assert {c.finish_reason for c in reply.choices} == {"length"}
    # A request's own values win.
    own = client.completions.create(model=model, prompt="Once upon a time", max_tokens=9,
                                    temperature=1.0, seed=3, n=2)
    assert own.usage.completion_tokens == 2 * 9
    # Beam search takes no sampling defaults (it would refuse a temperature).
    beams = client.completions.create(model=model, prompt="Once upon a time", n=2,
                                      extra_body={"use_beam_search": True})
    assert len(beams.choices) == 2 and beams.usage.completion_tokens == 2 * 5
    response = client.responses.create(model=model, input="Tell me a long story.")
    assert response.status == "incomplete" and response.usage.output_tokens == 5
