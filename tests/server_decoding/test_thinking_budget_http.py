"""`thinking_token_budget` over HTTP (vLLM's request field), with the official openai client on
an in-process app with the deepseek_r1 reasoning parser (whose tags the app gives its engine);
`--reasoning-config` and `--reasoning-parser` into the engine's reasoning_config."""

from __future__ import annotations

import json

import pytest

import ksana_llm as kt
from tests.server_decoding.harness import QUESTION, extra_field, run_r1
from tests.server_process import openai_error

# The chat continues an assistant turn that opened the thinking block.
OPENED = [*QUESTION, {"role": "assistant", "content": "<think>\n"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def test_budget_closes_the_reasoning_over_chat_and_completions(r1_app, default_model):
    end_ids = default_model.tokenizer.encode("</think>", add_special_tokens=False)

    async def check(aclient, http):
        kwargs = dict(model="r1", messages=OPENED, temperature=0, max_tokens=30,
                      extra_body={**CONTINUE, "thinking_token_budget": 5,
                                  "return_token_ids": True})
        choice = (await aclient.chat.completions.create(**kwargs)).choices[0]
        token_ids = extra_field(choice, "token_ids")
        assert token_ids[5:5 + len(end_ids)] == end_ids
        reasoning = extra_field(choice.message, "reasoning_content")
        assert reasoning.strip() == default_model.tokenizer.decode(token_ids[:5]).strip()
        parts = ["", ""]
        async for chunk in await aclient.chat.completions.create(**kwargs, stream=True):
            if chunk.choices:
                parts[0] += extra_field(chunk.choices[0].delta, "reasoning_content") or ""
                parts[1] += chunk.choices[0].delta.content or ""
        assert parts == [reasoning, choice.message.content or ""]
        # Completions: no parser, the forced tag is in the text.
        prompt = default_model.tokenizer.encode("Question: 2+2?\n<think>\n")
        text = (await aclient.completions.create(
            model="r1", prompt=prompt, temperature=0, max_tokens=8,
            extra_body={"thinking_token_budget": 2})).choices[0].text
        assert "</think>" in text
        # Refused as a 400 naming the field; the app goes on serving.
        r = await http.post("/completions", json={"prompt": "x", "thinking_token_budget": -1})
        assert r.status_code == 400 and openai_error(r)["param"] == "thinking_token_budget"
        assert (await aclient.completions.create(model="r1", prompt="Hi", max_tokens=2)).choices

    run_r1(r1_app, check)


def test_structured_answers_and_forced_calls_after_an_opened_block_parse_the_reasoning(r1_app):
    """The engine constrains only the answer after the thinking block (vLLM's way), so the
    server parses the block out of JSON answers and forced tool calls too: the thinking is
    reasoning_content, the content is the JSON, the call is a tool call -- streamed alike."""
    tool = {"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    cases = {"json": dict(response_format={"type": "json_object"}),
             "required": dict(tools=[tool], tool_choice="required")}

    async def check(aclient, _http):
        for case, extra in cases.items():
            kwargs = dict(model="r1", messages=OPENED, temperature=0, max_tokens=60, **extra,
                          extra_body={**CONTINUE, "thinking_token_budget": 4})
            choice = (await aclient.chat.completions.create(**kwargs)).choices[0]
            message = choice.message
            reasoning = extra_field(message, "reasoning_content")
            assert reasoning and "</think>" not in reasoning, (case, message)
            if case == "json":
                assert choice.finish_reason == "stop", message
                assert isinstance(json.loads(message.content), dict), message
            else:
                assert choice.finish_reason == "tool_calls" and not message.content, message
                (call,) = message.tool_calls
                assert call.function.name == "capital", message
                assert "city" in json.loads(call.function.arguments)
            parts = {"reasoning": "", "content": "", "arguments": ""}
            async for chunk in await aclient.chat.completions.create(**kwargs, stream=True):
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    parts["reasoning"] += extra_field(delta, "reasoning_content") or ""
                    parts["content"] += delta.content or ""
                    parts["arguments"] += "".join(c.function.arguments or ""
                                                  for c in delta.tool_calls or [])
            assert parts == {"reasoning": reasoning, "content": message.content or "",
                             "arguments": message.tool_calls[0].function.arguments
                             if message.tool_calls else ""}, case

    run_r1(r1_app, check)


def test_a_server_without_a_reasoning_parser_refuses_the_budget(default_model):
    from ksana_llm.server.app import build_app

    engine = kt.Engine(default_model, num_device_blocks=32)

    async def check(_aclient, http):
        r = await http.post("/chat/completions", json={
            "messages": QUESTION, "max_tokens": 4, "thinking_token_budget": 3})
        assert r.status_code == 400 and openai_error(r)["param"] == "thinking_token_budget"
        assert "--reasoning-parser" in openai_error(r)["message"]

    try:
        run_r1(build_app(engine, served_model_name="r1"), check)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("flags, expected", [
    ([], None),
    (["--reasoning-parser", "deepseek_r1"], ("<think>", "</think>", None)),
    (["--reasoning-parser", "seed_oss"], ("<seed:think>", "</seed:think>", None)),
    # harmony: thought is what comes before the final channel
    (["--reasoning-parser", "openai_gptoss"],
     ("<|start|>assistant", "<|end|><|start|>assistant<|channel|>final<|message|>",
      "<|channel|>final<|message|>")),
    (["--reasoning-config", '{"reasoning_start_str": "<t>", "reasoning_end_str": "</t>"}'],
     ("<t>", "</t>", None)),
    # A phrase before the tag: the parser's tag is what ends a block the model closes.
    (["--reasoning-parser", "qwen3", "--reasoning-config",
      '{"reasoning_start_str": "<think>", "reasoning_end_str": "Time to answer.</think>"}'],
     ("<think>", "Time to answer.</think>", "</think>")),
    (["--reasoning-parser", "qwen3", "--skip-tokenizer-init"], None)])
def test_reasoning_flags_reach_the_engine_config(flags, expected):
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    config = configs_from_args(build_parser().parse_args(["serve", *flags]))[0].reasoning_config
    assert expected == (None if config is None else (
        config.reasoning_start_str, config.reasoning_end_str, config.reasoning_end_tag))


def test_a_bad_reasoning_config_names_the_flag():
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    with pytest.raises(ValueError, match="--reasoning-config"):
        configs_from_args(build_parser().parse_args(
            ["serve", "--reasoning-config", '{"reasoning_start_str": "<t>"}']))
