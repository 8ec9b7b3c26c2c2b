"""vLLM's `skip_tokenizer_init`: no tokenizer is loaded; prompts are token ids and outputs carry
token ids (transformers' greedy tokens on the same weights) with empty text. What needs text is
refused naming its field: in Python a ValueError, over HTTP a 400 with the OpenAI error body,
on a real `ksana-llm serve --skip-tokenizer-init` subprocess driven by the official client."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

import ksana_llm as kt
from ksana_llm.server.serve_options import OutputParsing, check_tokenizer
from tests.server_process import openai_error, server_fixture

PROMPT = "The capital of France is"
NEW_TOKENS = 8

server = server_fixture(["--skip-tokenizer-init", "--max-num-seqs", "8"])


@pytest.fixture(scope="module")
def ids(default_model):
    return list(default_model.tokenizer.encode(PROMPT))


@pytest.fixture(scope="module")
def expected(hf_default_model, ids):
    """transformers' greedy continuation of `ids` (EOS ignored)."""
    with torch.no_grad():
        out = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def engine(default_model_dir):
    with kt.Engine(str(default_model_dir), skip_tokenizer_init=True, device="cpu",
                   num_device_blocks=64) as e:
        yield e


GREEDY = kt.GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)


# ---- Python API ---------------------------------------------------------------------------------

def test_engine_runs_on_token_ids_without_a_tokenizer(engine, default_model, ids, expected):
    assert engine.tokenizer is None and engine.model.tokenizer is None
    assert engine.config.skip_tokenizer_init
    out = engine.generate_outputs([ids], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == expected and out.text == ""
    # EOS ids still come from the model folder's generation_config.json / config.json.
    assert engine.model.eos_token_ids and \
        set(engine.model.eos_token_ids) <= set(default_model.eos_token_ids)


def test_text_and_stop_strings_are_refused_by_name(engine, ids):
    with pytest.raises(ValueError, match="prompt: this engine has no tokenizer"):
        engine.generate(PROMPT, GREEDY)
    with pytest.raises(ValueError, match="stop: stop strings .* use stop_token_ids"):
        engine.generate([ids], GREEDY.replace(stop=["Paris"]))
    with pytest.raises(ValueError, match="messages: .*no tokenizer"):
        engine.chat([{"role": "user", "content": "hi"}], GREEDY)
    # Nothing was lost: the engine still serves.
    assert len(engine.generate_outputs([ids], GREEDY.replace(stop_token_ids=[0]),
                                       use_tqdm=False)[0].token_ids) == NEW_TOKENS


def test_loaded_model_drops_its_tokenizer_and_a_given_one_is_refused(default_model, ids,
                                                                     expected):
    with kt.Engine(default_model, skip_tokenizer_init=True, num_device_blocks=32) as e:
        assert e.tokenizer is None
        assert e.generate_outputs([ids], GREEDY, use_tqdm=False)[0].token_ids == expected
        assert e.model.module is default_model.module  # the same weights
    assert default_model.tokenizer is not None  # the caller's model unchanged
    with pytest.raises(ValueError, match="tokenizer: not with skip_tokenizer_init"):
        kt.Engine(default_model, default_model.tokenizer, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="tokenizer: not with skip_tokenizer_init"):
        kt.Model.from_pretrained(default_model.path, tokenizer=default_model.path,
                                 skip_tokenizer_init=True, progress=False)


def test_a_server_without_a_tokenizer_needs_the_flag(engine, default_model):
    check_tokenizer(engine, OutputParsing(), None)  # the engine was made with the flag
    for parsing, template, flag in ((OutputParsing(tool_call_parser="hermes"), None,
                                     "--tool-call-parser"),
                                    (OutputParsing(reasoning_parser="deepseek_r1"), None,
                                     "--reasoning-parser"),
                                    (OutputParsing(), "{{ messages }}", "--chat-template")):
        with pytest.raises(ValueError, match=f"{flag} works on text"):
            check_tokenizer(engine, parsing, template)
    # A model without a tokenizer, the flag not given: the server refuses to start.
    with kt.Engine(default_model.without_tokenizer(), num_device_blocks=16) as bare:
        with pytest.raises(ValueError, match="--skip-tokenizer-init"):
            check_tokenizer(bare, OutputParsing(), None)


# ---- the server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_completions_on_token_ids(server, client, model_name, ids, expected):
    reply = client.completions.create(model=model_name, prompt=ids, max_tokens=NEW_TOKENS,
                                      temperature=0, logprobs=2,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text == ""
    assert choice.model_extra["token_ids"] == expected
    assert choice.model_extra["prompt_token_ids"] == ids
    # Logprob entries name tokens by id (vLLM's return_tokens_as_token_ids form).
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in expected]
    assert all(k.startswith("token_id:") for top in choice.logprobs.top_logprobs for k in top)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == NEW_TOKENS


def test_streamed_completion_on_token_ids(server, client, model_name, ids, expected):
    stream = client.completions.create(model=model_name, prompt=ids, max_tokens=NEW_TOKENS,
                                       temperature=0, stream=True,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == ""
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []] == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_native_generate_and_embeddings_on_token_ids(server, model_name, ids, expected):
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "input_tokens": ids, "stream": False,
        "sampling_config": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_token_ids"][0] == expected and body["texts"] == [""]
    r = httpx.post(server.base_url + "/embeddings", json={"model": model_name, "input": [ids]},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"][0]["embedding"]) == 576


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/v1/responses", {"input": "hi"}, "input"),
    ("/v1/score", {"text_1": "a", "text_2": "b"}, "text_1"),
    ("/forward", {"requests": [{"prompt": PROMPT,
                                "request_target": [{"target_name": "logits"}]}]},
     "requests.0.prompt"),
    ("/v1/completions", {"prompt": PROMPT}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 3], "stop": ["Paris"]}, "stop"),
    ("/v1/completions", {"prompt": [1, 2, 3], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": [1, 2, 3], "bad_words": ["Paris"]}, "bad_words"),
    ("/v1/embeddings", {"input": PROMPT}, "input"),
    ("/tokenize", {"prompt": PROMPT}, "prompt"),
    ("/detokenize", {"tokens": [1, 2, 3]}, "tokens"),
    ("/generate", {"prompt": PROMPT, "stream": False}, "prompt"),
])
def test_what_needs_text_is_a_400_naming_its_field(server, model_name, ids, path, body,
                                                    param):
    if path.startswith("/v1/"):
        body = {"model": model_name, **body}
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = openai_error(r)
    assert error["param"] == param and "tokenizer" in error["message"]
    assert error["type"] == "invalid_request_error"
    # ... and the server keeps serving.
    ok = httpx.post(server.base_url + "/completions", timeout=60,
                    json={"model": model_name, "prompt": ids, "max_tokens": 1})
    assert ok.status_code == 200, ok.text
