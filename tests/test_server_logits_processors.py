"""`serve --logits-processors` with `vllm_xargs` on a real server and the official client: a
completion and a chat answer that set a processor's arguments are transformers' greedy tokens
with the same processor; bad arguments are a 400 naming `vllm_xargs`, a processor that fails a
500, and the server serves on. The flag's values reach the EngineConfig; bad ones are named."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.family_harness import hf_reference
from tests.server_process import ServerProcess
from tests.tiny_models import build_tiny_chat_model

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 8
PROCESSORS = ["tests.engine_logits_processors:BanTokens", "tests.engine_logits_processors:Exploding"]


def _greedy(reference, ids: list[int], ban: list[int] = ()) -> list[int]:
    """transformers' greedy tokens with `ban` suppressed (its SuppressTokensLogitsProcessor)."""
    ids = list(ids)
    out = []
    for _ in range(MAX_TOKENS):
        logits = reference(ids)[-1]
        logits[list(ban)] = float("-inf")
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


@pytest.fixture(scope="module")
def tiny(default_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("logits-processors") / "tiny"
    hf = build_tiny_chat_model(folder, default_model_dir, num_hidden_layers=2)
    return folder, hf_reference(hf), AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def server(tiny):
    proc = ServerProcess(["--model", str(tiny[0]), "--served-model-name", "tiny",
                          "--dtype", "float32", "--logits-processors", *PROCESSORS])
    yield proc
    proc.stop()


def test_vllm_xargs_reach_the_processors(server, client, tiny):
    _, reference, tokenizer = tiny
    ids = tokenizer(PROMPT)["input_ids"]
    plain = _greedy(reference, ids)
    ban = plain[:2]
    expected = _greedy(reference, ids, ban)
    assert expected != plain
    common = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0}
    # JSON booleans are arguments too (vLLM takes them).
    xargs = {"ban": ban, "explain": True, "flags": [False, 1]}
    text = client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True,
                                                                "vllm_xargs": xargs},
                                     **common).choices[0].text
    assert text == tokenizer.decode(expected)
    assert client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True},
                                     **common).choices[0].text == tokenizer.decode(plain)

    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    chat_ban = _greedy(reference, chat_ids)[:1]
    answer = client.chat.completions.create(
        messages=QUESTION, extra_body={"ignore_eos": True, "vllm_xargs": {"ban": chat_ban}},
        **common).choices[0].message.content
    assert answer == tokenizer.decode(_greedy(reference, chat_ids, chat_ban),
                                      skip_special_tokens=True)


def test_bad_arguments_and_failures(server, client):
    url = server.base_url + "/completions"
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    for xargs in ({"ban": "7"}, {"ban": [1, -2]}, {"ban": {"a": 1}}, "ban"):
        answer = httpx.post(url, json={**body, "vllm_xargs": xargs}, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"].startswith("vllm_xargs"), error
    answer = httpx.post(url, json={**body, "vllm_xargs": {"explode_at": 1}}, timeout=60)
    assert answer.status_code == 500, answer.text
    error = answer.json()["error"]
    assert error["code"] == "logits_processor_error"
    assert "logits processor Exploding failed: RuntimeError: out of ideas" in error["message"]
    # The server goes on serving.
    assert client.completions.create(**body).choices[0].text


def test_flag_reaches_the_engine_config():
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    config = configs_from_args(parse(["serve", "--logits-processors", *PROCESSORS]))[0]
    assert config.logits_processors == tuple(PROCESSORS)
    with pytest.raises(ValueError, match="--logits-processors: .*has no 'Nope'"):
        configs_from_args(parse(["serve", "--logits-processors",
                                 "tests.engine_logits_processors:Nope"]))
