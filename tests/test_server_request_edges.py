"""Small edges of the OpenAI routes, in-process on the session's engine: an empty `model`
means the served model (vLLM's rule), a content part without a `type` and an unknown Responses
`include` value are 400s that say what is wrong, and the logprobs cap of a server without one
(`--max-logprobs -1`) is the vocabulary."""

from __future__ import annotations

import httpx
import pytest

import ksana_llm as kt
from ksana_llm.server.app import build_app
from ksana_llm.server.serve_options import OutputParsing
from tests.server_decoding.harness import run_r1

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def app(local_engine):
    return build_app(local_engine, served_model_name="m")


def _post(app, path: str, body: dict) -> httpx.Response:
    async def post(_aclient, http: httpx.AsyncClient):
        return await http.post(path, json=body)

    return run_r1(app, post)


def test_an_empty_model_name_is_the_served_model(app):
    r = _post(app, "/chat/completions", {"model": "", "messages": HI, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "m", r.text
    assert _post(app, "/chat/completions", {"model": "other", "messages": HI,
                                            "max_tokens": 1}).status_code == 404


def test_a_content_part_without_a_type(app):
    r = _post(app, "/chat/completions", {"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"text": "Hi"}]}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages.0.content.0"
    assert "needs a `type`" in error["message"]


def test_an_unknown_include_value_is_named(app):
    r = _post(app, "/responses", {"model": "m", "input": "Hi", "max_output_tokens": 1,
                                  "include": ["bogus", "message.output_text.logprobs"]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "include"
    assert "bogus" in error["message"] and "message.output_text.logprobs" in error["message"]


def test_without_a_cap_the_vocabulary_is_the_limit(default_model):
    with kt.Engine(default_model, num_device_blocks=16, max_logprobs=-1) as engine:
        app = build_app(engine, served_model_name="m", parsing=OutputParsing(max_logprobs=-1))
        vocab = engine.model.vocab_size
        r = _post(app, "/chat/completions", {"model": "m", "messages": HI, "max_tokens": 1,
                                             "logprobs": True, "top_logprobs": vocab + 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "top_logprobs"
    assert f"at most the vocabulary size ({vocab})" in error["message"]
