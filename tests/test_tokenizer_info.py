"""vLLM's `GET /tokenizer_info` (`--enable-tokenizer-info-endpoint`): the served tokenizer's
configuration, checked against the model folder's own tokenizer_config.json and the tokenizer
transformers loads from it; the chat template is the one the server renders with. Without the
flag the route does not exist."""

from __future__ import annotations

import json

import httpx
import pytest

import ksana_llm as kt
from ksana_llm.server.app import build_app
from tests.server_decoding.harness import TEMPLATE, run_r1


@pytest.fixture(scope="module")
def engine(default_model):
    with kt.Engine(default_model, num_device_blocks=16) as eng:
        yield eng


def _get(app, path: str) -> httpx.Response:
    async def get(_aclient, http: httpx.AsyncClient):
        return await http.get(path)

    return run_r1(app, get)


def test_the_tokenizer_config_as_its_file_spells_it(engine, default_model_dir):
    from transformers import AutoTokenizer

    info = _get(build_app(engine, served_model_name="m", enable_tokenizer_info_endpoint=True),
                "http://r1/tokenizer_info")
    assert info.status_code == 200, info.text
    body = info.json()
    reference = AutoTokenizer.from_pretrained(default_model_dir)
    assert body["tokenizer_class"] == type(reference).__name__
    assert body["chat_template"] == reference.chat_template
    on_disk = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    for key, value in on_disk.items():
        if key not in ("added_tokens_decoder", "tokenizer_class"):
            assert body[key] == value, key
    # A --chat-template is what the server renders with, so it is what it reports.
    custom = _get(build_app(engine, served_model_name="m", chat_template=TEMPLATE,
                            enable_tokenizer_info_endpoint=True), "http://r1/tokenizer_info").json()
    assert custom["chat_template"] == TEMPLATE


def test_without_the_flag_there_is_no_route(engine):
    assert _get(build_app(engine, served_model_name="m"), "http://r1/tokenizer_info").status_code == 404


def test_the_serve_flag():
    from ksana_llm.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve", "--enable-tokenizer-info-endpoint"]).enable_tokenizer_info_endpoint
    assert not parse(["serve"]).enable_tokenizer_info_endpoint
