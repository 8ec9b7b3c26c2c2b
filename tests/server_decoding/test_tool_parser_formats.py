"""Tool-call formats end to end: the model's output is forced (guided_regex) into a format, and
the OpenAI app with that `--tool-call-parser` answers the `openai` client with the calls,
streamed and not -- Qwen3-Coder's and GLM-4.5's typed by the request's tool schema, Kimi-K2's
with the ids its markup gives. In-process apps on the session's model (as the deepseek_r1 one)."""

from __future__ import annotations

import json

import pytest

import ksana_llm as kt
from tests.server_decoding.harness import run_r1

FORECAST_TOOL = {"type": "function", "function": {
    "name": "forecast", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}}
QUESTION = [{"role": "user", "content": "Forecast for Paris?"}]


@pytest.fixture(scope="module")
def parser_apps(default_model):
    """An app per parser, sharing one engine."""
    from ksana_llm.server.app import build_app
    from ksana_llm.server.serve_options import OutputParsing

    engine = kt.Engine(default_model, num_device_blocks=128)
    yield {name: build_app(engine, served_model_name=name, parsing=OutputParsing(
        tool_call_parser=name, enable_auto_tool_choice=True))
        for name in ("qwen3_coder", "kimi_k2", "glm45")}
    engine.shutdown()


async def _both(aclient, kwargs) -> tuple:
    """The non-streamed message, and the streamed calls as {index: [id, name, arguments]}."""
    message = (await aclient.chat.completions.create(**kwargs)).choices[0]
    streamed: dict[int, list] = {}
    async for chunk in await aclient.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, [d.id, d.function.name, ""])
                entry[2] += d.function.arguments or ""
    return message, streamed


def test_qwen3_coder_calls_typed_by_the_tool_schema(parser_apps):
    # (Held to the regex a token at a time, SmolLM2 spells the tags out in short pieces.)
    regex = (r"Checking\.\n<tool_call>\n<function=forecast>\n<parameter=city>\n[A-Z][a-z]{2,6}\n"
             r"</parameter>\n<parameter=days>\n[1-7]\n</parameter>\n<parameter=metric>\ntrue\n"
             r"</parameter>\n</function>\n</tool_call>")

    async def check(aclient, _http):
        kwargs = dict(model="qwen3_coder", messages=QUESTION, tools=[FORECAST_TOOL], temperature=0,
                      max_tokens=400, extra_body={"guided_regex": regex})
        choice, streamed = await _both(aclient, kwargs)
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "forecast" and set(args) == {"city", "days", "metric"}
        assert isinstance(args["days"], int) and args["metric"] is True and isinstance(args["city"], str)
        assert [entry[1:] for entry in streamed.values()] == [["forecast", call.function.arguments]]

    run_r1(parser_apps["qwen3_coder"], check)


def test_glm45_calls_typed_by_the_tool_schema(parser_apps):
    regex = (r"<tool_call>forecast\n<arg_key>city</arg_key>\n<arg_value>[1-7]</arg_value>\n"
             r"<arg_key>days</arg_key>\n<arg_value>[1-7]</arg_value>\n</tool_call>")

    async def check(aclient, _http):
        kwargs = dict(model="glm45", messages=QUESTION, tools=[FORECAST_TOOL], temperature=0,
                      max_tokens=300, extra_body={"guided_regex": regex})
        choice, streamed = await _both(aclient, kwargs)
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        # Both values are digits: the city (a string in the schema) stays text, days is a number.
        assert call.function.name == "forecast" and set(args) == {"city", "days"}
        assert isinstance(args["city"], str) and isinstance(args["days"], int)
        assert [entry[1:] for entry in streamed.values()] == [["forecast", call.function.arguments]]

    run_r1(parser_apps["glm45"], check)


def test_kimi_k2_call_ids_come_from_the_markup(parser_apps):
    regex = (r"<\|tool_calls_section_begin\|><\|tool_call_begin\|>functions\.forecast:0"
             r"<\|tool_call_argument_begin\|>\{\"city\": \"[A-Z][a-z]{2,6}\"\}<\|tool_call_end\|>"
             r"<\|tool_calls_section_end\|>")

    async def check(aclient, _http):
        kwargs = dict(model="kimi_k2", messages=QUESTION, tools=[FORECAST_TOOL], temperature=0,
                      max_tokens=120, extra_body={"guided_regex": regex})
        choice, streamed = await _both(aclient, kwargs)
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert (call.id, call.function.name) == ("functions.forecast:0", "forecast")
        assert set(json.loads(call.function.arguments)) == {"city"}
        assert list(streamed.values()) == [["functions.forecast:0", "forecast", call.function.arguments]]
        # A call tool_choice forces (JSON, no markup) gets an id of that shape too.
        forced, streamed = await _both(aclient, dict(
            model="kimi_k2", messages=QUESTION, tools=[FORECAST_TOOL], temperature=0, max_tokens=40,
            tool_choice={"type": "function", "function": {"name": "forecast"}}))
        assert [c.id for c in forced.message.tool_calls] == ["functions.forecast:0"]
        assert [entry[0] for entry in streamed.values()] == ["functions.forecast:0"]

    run_r1(parser_apps["kimi_k2"], check)
