"""Where a chat request's tools reach the template: with `tool_choice: "none"` they are shown by
default (vLLM's default: the model knows them, no call is extracted), and not at all under
`--exclude-tools-when-tool-choice-none` (build_app's `exclude_tools_when_tool_choice_none`);
other tool choices always show them. Checked on the prompt ids the server reports
(`return_token_ids`) against the template rendered by transformers' tokenizer."""

from __future__ import annotations

import pytest

import ksana_llm as kt
from ksana_llm.server.app import build_app
from tests.server_decoding.harness import QUESTION, TEMPLATE, TOOLS, run_r1


@pytest.fixture(scope="module")
def engine(default_model):
    with kt.Engine(default_model, num_device_blocks=64) as eng:
        yield eng


def _rendered(tokenizer, tools) -> list[int]:
    text = tokenizer.apply_chat_template(QUESTION, tools=tools, chat_template=TEMPLATE,
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("exclude", [False, True])
def test_tool_choice_none_and_the_exclude_flag(engine, exclude):
    app = build_app(engine, served_model_name="m", chat_template=TEMPLATE,
                    exclude_tools_when_tool_choice_none=exclude)
    with_tools, without = _rendered(engine.tokenizer, TOOLS), _rendered(engine.tokenizer, None)
    assert with_tools != without

    async def check(_aclient, http):
        prompts = {}
        for choice in ("none", "required"):
            r = await http.post("/chat/completions", json={
                "model": "m", "messages": QUESTION, "tools": TOOLS, "tool_choice": choice,
                "max_tokens": 1, "return_token_ids": True})
            assert r.status_code == 200, r.text
            prompts[choice] = r.json()["prompt_token_ids"]
        return prompts

    prompts = run_r1(app, check)
    assert prompts["none"] == (without if exclude else with_tools)
    assert prompts["required"] == with_tools


def test_the_serve_flag_reaches_build_app():
    from ksana_llm.cli import build_parser
    from ksana_llm.server.serve_options import request_options_from_args

    parse = build_parser().parse_args
    assert request_options_from_args(parse(["serve", "--exclude-tools-when-tool-choice-none"])) \
        ["exclude_tools_when_tool_choice_none"] is True
    assert request_options_from_args(parse(["serve"]))["exclude_tools_when_tool_choice_none"] \
        is False
