"""Structured output (JSON schema, JSON object, regex, choice), tool calls (named, required, auto
with the hermes parser) and reasoning parsers (qwen3, deepseek_r1) through real `ksana-llm serve`
processes on SmolLM2 (the servers: conftest.py here)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server_decoding.harness import PROMPT, QUESTION, TOOLS, client_tokens, extra_field, run_r1
from tests.server_process import openai_error


# ---- structured output ---------------------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                      "country": {"type": "string", "enum": ["France", "Japan", "Peru", "Other"]}},
     "required": ["city", "country"]},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20},
                                      "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                                               "maxItems": 2},
                                      "done": {"type": "boolean"}},
     "required": ["title", "tags", "done"]},
]
JSON_PROMPTS = [
    "Describe a person.", "Who wrote Hamlet?", "Give me a user record.", "Invent a character.",
    "Where is the Eiffel Tower?", "Name a city in Japan.", "What is the capital of Peru?", "Pick a place.",
    "List your favourite colors.", "What colors are in a rainbow?", "Name some colors.", "Paint a sunset.",
    "Is the sky blue?", "Can fish fly?", "Will it rain tomorrow?", "Is Paris in France?",
    "Make a todo item.", "Summarise a book.", "Create a task.", "Plan a trip.",
]


def test_json_schema_outputs_validate_for_20_prompts(server, model):
    async def one(aclient: openai.AsyncOpenAI, i: int):
        schema = SCHEMAS[i % len(SCHEMAS)]
        reply = await aclient.chat.completions.create(
            model=model, messages=[{"role": "user", "content": JSON_PROMPTS[i]}], temperature=0,
            max_tokens=80, response_format={"type": "json_schema", "json_schema": {
                "name": f"s{i % len(SCHEMAS)}", "schema": schema, "strict": True}})
        return schema, reply.choices[0]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(len(JSON_PROMPTS))))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 20
    for schema, choice in results:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    # Free text for the same prompts would not be JSON: the constraint did the work.
    assert len({c.message.content for _, c in results}) > 10


def test_json_object_and_streaming(client, model):
    kwargs = dict(model=model, messages=QUESTION, temperature=0, max_tokens=40,
                  response_format={"type": "json_object"})
    reply = client.chat.completions.create(**kwargs)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == reply.choices[0].message.content


def test_regex_and_choice_on_completions_and_generate(server, client, model):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    out = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=12,
                                    extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    choice = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8,
                                            extra_body={"guided_choice": ["Lyon", "Paris", "Nice"]})
    assert choice.choices[0].message.content in ("Lyon", "Paris", "Nice")
    # KsanaLLM /generate: structured_output_regex, and json_schema with enable_structured_output.
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": PROMPT, "structured_output_regex": regex, "stream": False,
        "sampling_config": {"max_new_tokens": 12}})
    assert r.status_code == 200, r.text
    assert re.fullmatch(regex, r.json()["texts"][0])
    schema = SCHEMAS[3]
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": "Is the sky blue? Answer in JSON.", "stream": False, "sampling_config": {
            "max_new_tokens": 40, "enable_structured_output": True, "json_schema": json.dumps(schema)}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["texts"][0]), schema)


def test_emoji_choices_and_schema_keywords_the_grammar_would_not_enforce(server, client, model):
    """An emoji in a choice used to reach the grammar as two UTF-16 halves (json.dumps' ASCII
    escapes), and the answer was U+FFFD garbage; a schema keyword xgrammar ignores used to be
    accepted and broken ({"ids": [7, 7, 7]} under uniqueItems)."""
    choices = ["\U0001F600 yes", "\U0001F600 no"]
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                           max_tokens=12, extra_body={"guided_choice": choices})
    assert reply.choices[0].message.content in choices
    schema = {"type": "object", "properties": {"ids": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "required": ["ids"]}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": QUESTION, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "ids", "schema": schema}}})
    assert r.status_code == 400, r.text
    error = openai_error(r)
    assert error["param"].startswith("response_format")
    assert "properties.ids.uniqueItems" in error["message"]
    assert client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2).choices


# ---- tool calls ------------------------------------------------------------------------------------

def _check_call(call, tools=TOOLS) -> dict:
    assert call.id.startswith("call_") and call.type == "function"
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def _stream_tool_calls(chunks) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert entry["id"] is None  # the id comes once, with the name
                    entry["id"], entry["name"] = d.id, d.function.name
                else:
                    assert entry["id"] is not None  # arguments follow their call's name
                entry["arguments"] += d.function.arguments or ""
    return calls, finish, content


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}},
                                         "required"], ids=["named", "required"])
def test_tool_call_round_trip(client, model, tool_choice):
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    kwargs = dict(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                  temperature=0, max_tokens=80)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    # OpenAI and vLLM: "tool_calls" for calls the model chose ("required"), "stop" for the call
    # to the function tool_choice named.
    want_finish = "stop" if isinstance(tool_choice, dict) else "tool_calls"
    assert choice.finish_reason == want_finish and choice.message.content is None
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        _check_call(call)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]

    calls, finish, content = _stream_tool_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == want_finish and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]

    # The tools reached the template (it lists their names in a system turn).
    tok_prompt = reply.usage.prompt_tokens
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert tok_prompt > plain.usage.prompt_tokens

    # A second turn with the call and its result renders and runs.
    follow = client.chat.completions.create(model=model, temperature=0, max_tokens=8, tools=TOOLS,
                                            tool_choice="none", messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                          "arguments": c.function.arguments}}
            for c in choice.message.tool_calls]},
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "18 C, sunny"}])
    assert follow.choices[0].message.tool_calls == [] and follow.choices[0].message.content


def test_required_calls_to_tools_whose_schemas_refer_to_their_definitions(client, model):
    """openai.pydantic_function_tool writes nested models as `$defs` + `$ref`: with "required"
    the tools' schemas sit inside one array schema, where those references must still resolve
    (they once made the request a 400 naming `tools`)."""
    from pydantic import BaseModel

    class Place(BaseModel):
        city: str
        country: str

    class Trip(BaseModel):
        origin: Place
        destination: Place
        travellers: int

    tool = openai.pydantic_function_tool(Trip)
    assert "$defs" in tool["function"]["parameters"]
    tools = [tool, TOOLS[0]]
    reply = client.chat.completions.create(
        model=model, temperature=0, max_tokens=120, tools=tools, tool_choice="required",
        parallel_tool_calls=False,
        messages=[{"role": "user", "content": "Book a trip from Paris to Rome for two."}])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check_call(call, tools)  # (jsonschema resolves the tool's own $defs)


def test_tool_parameters_must_describe_an_object(client, model):
    """A call's arguments are a JSON object (OpenAI's rule, which clients rely on)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, max_tokens=8, tool_choice="required",
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "ping",
                                                     "parameters": {"type": "string"}}}])
    assert info.value.body["param"] == "tools.0.function.parameters"


@pytest.mark.parametrize("parameters, where", [
    ({"type": "object", "properties": {"a": {"type": "strng"}}}, "properties.a.type"),
    ({"type": "object", "properties": 5}, "properties"),
    ({"type": "object", "required": "a"}, "required"),
    ({"type": "object", "$schema": ["x"]}, None),  # (not a draft's name: was a 500)
])
@pytest.mark.parametrize("tool_choice", ["none", "auto", "required"])
def test_an_invalid_parameters_schema_is_a_400_whatever_the_tool_choice(client, model, parameters,
                                                                        where, tool_choice):
    """OpenAI refuses a tool whose parameters are not a valid JSON Schema (it was accepted
    unless tool_choice compiled it), naming the tool; the second tool here is the bad one."""
    tools = [TOOLS[0], {"type": "function", "function": {"name": "ping", "parameters": parameters}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, max_tokens=4, tool_choice=tool_choice,
                                       messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert info.value.body["param"] == "tools.1.function.parameters"
    if where is not None:
        assert f"at {where}:" in info.value.body["message"]


def test_auto_tool_choice_with_hermes_parser(client, model):
    """The model's output is forced into the hermes shape; the parser turns it into tool_calls."""
    regex = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "[A-Z][a-z]{2,6}", "unit": "celsius"\}\}\n</tool_call>')
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                  tool_choice="auto", temperature=0, max_tokens=80, extra_body={"guided_regex": regex})
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(_check_call(call)) == {"city", "unit"}
    calls, finish, content = _stream_tool_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and content == "Sure."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    # tool_choice "none": the same text stays content.
    none = client.chat.completions.create(**{**kwargs, "tool_choice": "none", "max_tokens": 16})
    assert none.choices[0].message.tool_calls == [] and "<tool_call>" in none.choices[0].message.content


def test_parallel_tool_calls_false_keeps_the_first_auto_call(client, model):
    """OpenAI returns at most one call with parallel_tool_calls false; a model that writes two
    (forced here) gets its first only, streamed and not."""
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "%s"\}\}\n</tool_call>'
    regex = (call % "Paris") + "\n" + (call % "Rome")
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris and Rome?"}],
                  tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=160,
                  extra_body={"guided_regex": regex})
    both = client.chat.completions.create(**kwargs).choices[0]
    assert [json.loads(c.function.arguments)["city"] for c in both.message.tool_calls] == \
        ["Paris", "Rome"]
    one = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    assert [json.loads(c.function.arguments)["city"] for c in one.message.tool_calls] == ["Paris"]
    assert one.finish_reason == "tool_calls"
    calls, finish, _ = _stream_tool_calls(client.chat.completions.create(
        **kwargs, parallel_tool_calls=False, stream=True))
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == ["Paris"]


# ---- reasoning -------------------------------------------------------------------------------------

def test_reasoning_effort_reaches_the_template(client, model, server):
    """`reasoning_effort` (chat) and `reasoning.effort` (Responses) are handed to the chat
    template, as vLLM hands them; a value OpenAI does not define is a 400."""
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
    high = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1,
                                          reasoning_effort="high")
    line = len(client_tokens(client, "Reasoning: high\n"))
    assert high.usage.prompt_tokens == plain.usage.prompt_tokens + line
    response = client.responses.create(model=model, input=QUESTION[0]["content"],
                                       max_output_tokens=1, reasoning={"effort": "high"})
    assert response.usage.input_tokens == high.usage.prompt_tokens
    for route, body, param in (
            ("/chat/completions", {"messages": QUESTION, "reasoning_effort": "extreme"},
             "reasoning_effort"),
            ("/responses", {"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort")):
        response = httpx.post(server.base_url + route, json=body, timeout=30)
        assert response.status_code == 400 and openai_error(response)["param"] == param


def test_reasoning_qwen3(client, model):
    regex = r"<think>[a-z ]{5,20}</think>[A-Z][A-Za-z ,.]{5,20}"
    kwargs = dict(model=model, messages=QUESTION, temperature=0, max_tokens=50)
    reply = client.chat.completions.create(**kwargs, extra_body={"structured_outputs": {"regex": regex}})
    message = reply.choices[0].message
    reasoning = extra_field(message, "reasoning_content")
    assert re.fullmatch(r"[a-z ]{5,20}", reasoning or "") and re.fullmatch(r"[A-Z][A-Za-z ,.]{5,20}",
                                                                          message.content), message
    parts = ["", ""]
    for chunk in client.chat.completions.create(**kwargs, stream=True,
                                                extra_body={"structured_outputs": {"regex": regex}}):
        if chunk.choices:
            parts[0] += extra_field(chunk.choices[0].delta, "reasoning_content") or ""
            parts[1] += chunk.choices[0].delta.content or ""
    assert parts == [reasoning, message.content]
    # vLLM's include_reasoning false: the reasoning is parsed out and left out of the answer.
    hidden = client.chat.completions.create(**kwargs, extra_body={
        "structured_outputs": {"regex": regex}, "include_reasoning": False})
    assert extra_field(hidden.choices[0].message, "reasoning_content") is None
    assert hidden.choices[0].message.content == message.content
    streamed = [c.choices[0].delta for c in client.chat.completions.create(
        **kwargs, stream=True, extra_body={"structured_outputs": {"regex": regex},
                                           "include_reasoning": False}) if c.choices]
    assert not any(extra_field(d, "reasoning_content") for d in streamed)
    assert "".join(d.content or "" for d in streamed) == message.content
    # enable_thinking false reaches the template (Qwen3-style: it writes an empty thinking block
    # into the prompt) and turns the parser off: the forced tags stay in the content.
    raw = client.chat.completions.create(**kwargs, extra_body={
        "structured_outputs": {"regex": regex}, "chat_template_kwargs": {"enable_thinking": False}})
    assert raw.usage.prompt_tokens == reply.usage.prompt_tokens + len(
        client_tokens(client, "<think>\n\n</think>\n\n"))
    assert extra_field(raw.choices[0].message, "reasoning_content") is None
    assert re.fullmatch(regex, raw.choices[0].message.content)
    # A template that opens the block in the prompt (Qwen3-Thinking-2507): the output is
    # reasoning until its "</think>", streamed or not. The thinking is free (the grammar
    # constrains the answer after it), here 6 tokens long (thinking_token_budget).
    answer = r"[A-Z][A-Za-z ,.]{5,20}"
    opened = dict(kwargs, extra_body={"structured_outputs": {"regex": answer},
                                      "thinking_token_budget": 6,
                                      "chat_template_kwargs": {"open_thinking": True}})
    choice = client.chat.completions.create(
        **dict(opened, extra_body={**opened["extra_body"], "return_token_ids": True})).choices[0]
    message = choice.message
    reasoning = extra_field(message, "reasoning_content")
    end_ids = client_tokens(client, "</think>")
    assert extra_field(choice, "token_ids")[6:6 + len(end_ids)] == end_ids
    assert reasoning and re.fullmatch(answer, message.content), message
    parts = ["", ""]
    for chunk in client.chat.completions.create(**opened, stream=True):
        if chunk.choices:
            parts[0] += extra_field(chunk.choices[0].delta, "reasoning_content") or ""
            parts[1] += chunk.choices[0].delta.content or ""
    assert parts == [reasoning, message.content]
    # Without a thinking block, qwen3 leaves the answer as content.
    plain = client.chat.completions.create(**{**kwargs, "max_tokens": 10})
    assert extra_field(plain.choices[0].message, "reasoning_content") is None and plain.choices[0].message.content


def test_reasoning_deepseek_r1(r1_app):
    regex = r"[a-z ]{5,20}</think>[A-Z][A-Za-z ,.]{5,20}"  # R1's template opened the block

    async def check(aclient, _http):
        kwargs = dict(model="r1", messages=QUESTION, temperature=0, max_tokens=50,
                      extra_body={"guided_regex": regex})
        message = (await aclient.chat.completions.create(**kwargs)).choices[0].message
        reasoning = extra_field(message, "reasoning_content")
        assert re.fullmatch(r"[a-z ]{5,20}", reasoning or "") and re.fullmatch(
            r"[A-Z][A-Za-z ,.]{5,20}", message.content), message
        parts = ["", ""]
        async for chunk in await aclient.chat.completions.create(**kwargs, stream=True):
            if chunk.choices:
                parts[0] += extra_field(chunk.choices[0].delta, "reasoning_content") or ""
                parts[1] += chunk.choices[0].delta.content or ""
        assert parts == [reasoning, message.content]

    run_r1(r1_app, check)


def test_tokenize_messages_with_tools_and_token_strings(server, default_model):
    """vLLM's /tokenize: `tools` with `messages` reach the chat template as on a chat request
    (this server's template lists them), and `return_token_strs` adds each token's string."""
    from tests.server_decoding.harness import TEMPLATE

    tok = default_model.tokenizer
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    r = httpx.post(server.url + "/tokenize", timeout=30,
                   json={"messages": messages, "tools": TOOLS, "return_token_strs": True})
    assert r.status_code == 200, r.text
    rendered = tok.apply_chat_template(messages, tools=TOOLS, chat_template=TEMPLATE,
                                       add_generation_prompt=True, tokenize=False)
    ids = tok.encode(rendered, add_special_tokens=False)
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    assert r.json()["token_strs"] == tok.convert_ids_to_tokens(ids)
    plain = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert len(plain["tokens"]) < len(ids) and plain["token_strs"] is None
    bad = httpx.post(server.url + "/tokenize", json={"prompt": "x", "tools": TOOLS}, timeout=30)
    assert bad.status_code == 400 and openai_error(bad)["param"] == "tools"
