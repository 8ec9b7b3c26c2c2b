"""The server side of the decoding features, on real `ksana-llm serve` processes with SmolLM2:
structured output (JSON schema, regex), tool calls (named, required, auto + hermes parser),
reasoning parsers (qwen3, deepseek_r1), the vLLM / KsanaLLM decoding parameters (n, best_of,
beam search, logit_bias, prompt logprobs, echo + logprobs, no_repeat_ngram_size) against the
Python API, vLLM's bad_words / allowed_token_ids / truncate_prompt_tokens against transformers,
and the 400s of invalid combinations.

Two servers: a real `ksana-llm serve` process with `--enable-auto-tool-choice --tool-call-parser
hermes --reasoning-parser qwen3 --max-logprobs 8` and a chat template that shows the tools and
`enable_thinking` it is given; and, in-process on the session's model (no second model load), an
app with the deepseek_r1 reasoning parser and no tool parser.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

import ksana_llm as kt
from tests.server_process import ServerProcess
from tests.tolerances import LOGIT_ATOL

KV_ARGS = ["--num-device-blocks", "256"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"

# SmolLM2's own template, plus what Qwen3's does with tools and enable_thinking=False, and a
# line for reasoning_effort (as gpt-oss's template writes one), so that the tests can see each
# reach the template.
TEMPLATE = (
    "{% if reasoning_effort is defined %}{{ 'Reasoning: ' + reasoning_effort + '\n' }}{% endif %}"
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | map(attribute='function') "
    "| map(attribute='name') | join(', ')) + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}, "required": ["timezone"]}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


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
    from ksana_llm.server.app import OutputParsing, build_app

    engine = kt.Engine(default_model, num_device_blocks=128)
    yield build_app(engine, served_model_name="r1", parsing=OutputParsing(reasoning_parser="deepseek_r1"))
    engine.shutdown()


def run_r1(app, fn):
    """`await fn(client)` with an AsyncOpenAI client talking to `app` in-process."""
    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r1/v1",
                                 timeout=120)
        aclient = openai.AsyncOpenAI(base_url="http://r1/v1", api_key="x", max_retries=0, http_client=http)
        try:
            return await fn(aclient, http)
        finally:
            await http.aclose()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _extra(obj, name: str):
    """A field the openai client does not model (vLLM's reasoning_content)."""
    return getattr(obj, name, None) if getattr(obj, name, None) is not None else (obj.model_extra or {}).get(name)


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
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        _check_call(call)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]

    calls, finish, content = _stream_tool_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and content == ""
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
        assert response.status_code == 400 and _error(response)["param"] == param


def test_reasoning_qwen3(client, model):
    regex = r"<think>[a-z ]{5,20}</think>[A-Z][A-Za-z ,.]{5,20}"
    kwargs = dict(model=model, messages=QUESTION, temperature=0, max_tokens=50)
    reply = client.chat.completions.create(**kwargs, extra_body={"structured_outputs": {"regex": regex}})
    message = reply.choices[0].message
    reasoning = _extra(message, "reasoning_content")
    assert re.fullmatch(r"[a-z ]{5,20}", reasoning or "") and re.fullmatch(r"[A-Z][A-Za-z ,.]{5,20}",
                                                                          message.content), message
    parts = ["", ""]
    for chunk in client.chat.completions.create(**kwargs, stream=True,
                                                extra_body={"structured_outputs": {"regex": regex}}):
        if chunk.choices:
            parts[0] += _extra(chunk.choices[0].delta, "reasoning_content") or ""
            parts[1] += chunk.choices[0].delta.content or ""
    assert parts == [reasoning, message.content]
    # enable_thinking false reaches the template (Qwen3-style: it writes an empty thinking block
    # into the prompt) and turns the parser off: the forced tags stay in the content.
    raw = client.chat.completions.create(**kwargs, extra_body={
        "structured_outputs": {"regex": regex}, "chat_template_kwargs": {"enable_thinking": False}})
    assert raw.usage.prompt_tokens == reply.usage.prompt_tokens + len(
        client_tokens(client, "<think>\n\n</think>\n\n"))
    assert _extra(raw.choices[0].message, "reasoning_content") is None
    assert re.fullmatch(regex, raw.choices[0].message.content)
    # Without a thinking block, qwen3 leaves the answer as content.
    plain = client.chat.completions.create(**{**kwargs, "max_tokens": 10})
    assert _extra(plain.choices[0].message, "reasoning_content") is None and plain.choices[0].message.content


def client_tokens(client, text: str) -> list[int]:
    r = httpx.post(str(client.base_url).removesuffix("/v1/").removesuffix("/v1") + "/tokenize",
                   json={"prompt": text, "add_special_tokens": False}, timeout=30)
    return r.json()["tokens"]


def test_reasoning_deepseek_r1(r1_app):
    regex = r"[a-z ]{5,20}</think>[A-Z][A-Za-z ,.]{5,20}"  # R1's template opened the block

    async def check(aclient, _http):
        kwargs = dict(model="r1", messages=QUESTION, temperature=0, max_tokens=50,
                      extra_body={"guided_regex": regex})
        message = (await aclient.chat.completions.create(**kwargs)).choices[0].message
        reasoning = _extra(message, "reasoning_content")
        assert re.fullmatch(r"[a-z ]{5,20}", reasoning or "") and re.fullmatch(
            r"[A-Z][A-Za-z ,.]{5,20}", message.content), message
        parts = ["", ""]
        async for chunk in await aclient.chat.completions.create(**kwargs, stream=True):
            if chunk.choices:
                parts[0] += _extra(chunk.choices[0].delta, "reasoning_content") or ""
                parts[1] += chunk.choices[0].delta.content or ""
        assert parts == [reasoning, message.content]

    run_r1(r1_app, check)


# ---- decoding parameters against the Python API ------------------------------------------------------

def _local(local_engine, prompt, **config):
    return local_engine.generate_outputs(prompt, kt.GenerationConfig(**config), use_tqdm=False)[0]


def test_beam_search_matches_python_api(server, client, model, local_engine):
    expected = _local(local_engine, PROMPT, max_new_tokens=8, num_beams=3, num_return_sequences=2)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=0,
                                    extra_body={"use_beam_search": True, "num_beams": 3})
    assert [c.text for c in out.choices] == [s.text for s in expected.sequences]
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": PROMPT, "stream": False,
        "sampling_config": {"max_new_tokens": 8, "num_beams": 3, "num_return_sequences": 2}})
    assert r.json()["texts"] == [s.text for s in expected.sequences]
    # Streamed, the beams arrive whole at the end, same texts.
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=0,
                                           stream=True, extra_body={"use_beam_search": True, "num_beams": 3}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [s.text for s in expected.sequences]
    # With stop strings: the beams that end on one say so.
    expected = _local(local_engine, "The three primary colors are", max_new_tokens=12,
                      num_beams=4, num_return_sequences=3, stop=[","])
    assert any(s.stop_reason == "," for s in expected.sequences)
    out = client.completions.create(model=model, prompt="The three primary colors are",
                                    max_tokens=12, n=3, temperature=0, stop=[","],
                                    extra_body={"use_beam_search": True, "num_beams": 4})
    assert [(c.text, c.finish_reason) for c in out.choices] == [
        (s.text, s.finish_reason) for s in expected.sequences]


def test_sampling_params_match_python_api(server, client, model, local_engine):
    tok = local_engine.tokenizer
    # n, seed: one engine request; streamed or not, the same choices as the Python API's.
    expected = _local(local_engine, PROMPT, max_new_tokens=6, do_sample=True, num_return_sequences=3,
                      seed=11, ignore_eos=True)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=3, seed=11,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [s.text for s in expected.sequences]
    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=3, seed=11,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert list(streamed.values()) == [s.text for s in expected.sequences]
    # best_of
    expected = _local(local_engine, PROMPT, max_new_tokens=6, do_sample=True, best_of=3, seed=5)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, best_of=3, seed=5)
    assert out.choices[0].text == expected.text
    # logit_bias, presence/frequency penalties, no_repeat_ngram_size, min_tokens, stop strings
    bias_id = tok.encode(" dog")[0]
    expected = _local(local_engine, PROMPT, max_new_tokens=10, logit_bias={bias_id: 8.0},
                      presence_penalty=0.5, frequency_penalty=0.3, no_repeat_ngram_size=2,
                      min_new_tokens=3)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                    logit_bias={str(bias_id): 8.0}, presence_penalty=0.5,
                                    frequency_penalty=0.3,
                                    extra_body={"no_repeat_ngram_size": 2, "min_tokens": 3})
    assert out.choices[0].text == expected.text and " dog" in out.choices[0].text
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": PROMPT, "stream": False, "sampling_config": {"max_new_tokens": 10, "no_repeat_ngram_size": 2}})
    assert r.json()["output_token_ids"] == [_local(local_engine, PROMPT, max_new_tokens=10,
                                                   no_repeat_ngram_size=2).token_ids]


def test_prompt_logprobs_and_echo(server, client, model, local_engine):
    ids = local_engine.tokenizer.encode(PROMPT)
    expected = _local(local_engine, PROMPT, max_new_tokens=3, prompt_logprobs=2, logprobs=2)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                    echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == PROMPT + expected.text
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([e["logprob"] for e in expected.prompt_logprobs[1:]],
                                                    abs=LOGIT_ATOL)
    assert lp.token_logprobs[len(ids):] == pytest.approx([e["logprob"] for e in expected.logprobs],
                                                           abs=LOGIT_ATOL)
    assert "".join(lp.tokens) == out.choices[0].text
    # vLLM's prompt_logprobs on chat and completions.
    r = httpx.post(server.base_url + "/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for token, entry, ref in zip(ids[1:], plp[1:], expected.prompt_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(ref["logprob"], abs=LOGIT_ATOL)
    chat = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        "messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


# ---- invalid input ---------------------------------------------------------------------------------

BAD = [
    # (id, route, body, param)
    ("invalid_json_schema", "/v1/chat/completions",
     {"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}},
     "response_format.json_schema.schema"),
    ("invalid_regex", "/v1/completions", {"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
    ("invalid_grammar", "/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= nope"}},
     "structured_outputs.grammar"),
    ("two_constraints", "/v1/chat/completions",
     {"messages": QUESTION, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ("response_format_type", "/v1/chat/completions", {"messages": QUESTION, "response_format": {"type": "xml"}},
     "response_format.type"),
    ("beam_with_temperature", "/v1/completions", {"prompt": "x", "use_beam_search": True, "temperature": 0.8},
     "temperature"),
    ("beam_with_top_p", "/v1/chat/completions", {"messages": QUESTION, "num_beams": 2, "top_p": 0.5}, "top_p"),
    ("beam_n_over_width", "/v1/completions", {"prompt": "x", "num_beams": 2, "n": 3}, "n"),
    ("length_penalty_without_beams", "/v1/completions", {"prompt": "x", "length_penalty": 0.7}, "length_penalty"),
    ("best_of_greedy", "/v1/completions", {"prompt": "x", "best_of": 2, "temperature": 0}, "best_of"),
    ("prompt_logprobs_over_cap", "/v1/completions", {"prompt": "x", "prompt_logprobs": 9}, "prompt_logprobs"),
    ("prompt_logprobs_streamed", "/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("named_tool_not_in_tools", "/v1/chat/completions",
     {"messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("required_without_tools", "/v1/chat/completions", {"messages": QUESTION, "tool_choice": "required"},
     "tool_choice"),
    ("duplicate_tool_names", "/v1/chat/completions", {"messages": QUESTION, "tools": [TIME_TOOL, TIME_TOOL]},
     "tools.1.function.name"),
    ("reserved_template_kwarg", "/v1/chat/completions",
     {"messages": QUESTION, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("allowed_token_ids_out_of_vocab", "/v1/completions",
     {"prompt": "x", "allowed_token_ids": [1, 10**7]}, "allowed_token_ids"),
    ("allowed_token_ids_empty", "/v1/completions", {"prompt": "x", "allowed_token_ids": []},
     "allowed_token_ids"),
    ("bad_words_empty_word", "/v1/chat/completions", {"messages": QUESTION, "bad_words": [" "]},
     "bad_words.0"),
    ("truncate_prompt_tokens_zero", "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("generate_bad_regex", "/generate", {"prompt": "x", "structured_output_regex": "[", "stream": False},
     "structured_output_regex"),
    ("generate_beam_sampling", "/generate",
     {"prompt": "x", "sampling_config": {"num_beams": 2, "topp": 0.5}}, "sampling_config.topp"),
]


@pytest.mark.parametrize("route,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_400(server, route, body, param):
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = _error(r)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_token_restrictions_match_transformers(client, model, hf_default_model, default_model):
    """`bad_words` (each word as written and after a space, vLLM's rule), `allowed_token_ids`
    and `truncate_prompt_tokens` give transformers' greedy tokens under its own processors
    (`bad_words_ids`, `suppress_tokens` of every other id) on the truncated prompt."""
    import torch

    tok = default_model.tokenizer
    ids = tok.encode(PROMPT)

    def hf_greedy(prompt_ids: list[int], **kwargs) -> list[int]:
        with torch.no_grad():
            out = hf_default_model.generate(torch.tensor([prompt_ids]), max_new_tokens=8,
                                            do_sample=False, attention_mask=torch.ones(
                                                1, len(prompt_ids), dtype=torch.long), **kwargs)
        return out[0, len(prompt_ids):].tolist()

    plain = hf_greedy(ids)
    word = tok.decode(plain[:1]).strip()  # the name greedy gives the cat
    # vLLM's rule: the word as written, and after a space when that is as many tokens but
    # another first token.
    plain_ids, spaced = (tok.encode(w, add_special_tokens=False) for w in (word, " " + word))
    banned = [plain_ids] + ([spaced] if len(spaced) == len(plain_ids)
                            and spaced[0] != plain_ids[0] else [])
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"bad_words": [word]}).choices[0].text
    assert word not in text
    assert text == tok.decode(hf_greedy(ids, bad_words_ids=banned), skip_special_tokens=True)

    allowed = sorted({*plain[2:], *tok.encode(" Tom and Jerry", add_special_tokens=False)})
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"allowed_token_ids": allowed}).choices[0].text
    others = [t for t in range(hf_default_model.config.vocab_size) if t not in set(allowed)]
    expected = hf_greedy(ids, suppress_tokens=others)
    assert set(expected) <= set(allowed) and expected != plain
    assert text == tok.decode(expected, skip_special_tokens=True)

    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 5})
    assert reply.usage.prompt_tokens == 5
    assert reply.choices[0].text == tok.decode(hf_greedy(ids[-5:]), skip_special_tokens=True)
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)  # -1: the context, which holds it all


def test_400_server_settings(server, client, model, r1_app):
    """What the servers' flags refuse: auto tool choice without --enable-auto-tool-choice and a
    parser (the deepseek_r1 app has none), logprobs over --max-logprobs 8."""
    async def check(_aclient, http):
        for body in ({"messages": QUESTION, "tools": TOOLS, "tool_choice": "auto"},
                     {"messages": QUESTION, "tools": TOOLS}):  # auto is the default with tools
            r = await http.post("/chat/completions", json=body)
            assert r.status_code == 400 and _error(r)["param"] == "tool_choice"
            assert "--enable-auto-tool-choice" in _error(r)["message"]

    run_r1(r1_app, check)
    for route, body, param in (("/chat/completions", {"messages": QUESTION, "logprobs": True,
                                                      "top_logprobs": 9}, "top_logprobs"),
                               ("/completions", {"prompt": "x", "logprobs": 9}, "logprobs")):
        r = httpx.post(server.base_url + route, json=body, timeout=60)
        assert r.status_code == 400 and _error(r)["param"] == param and "at most 8" in _error(r)["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=QUESTION, logprobs=True, top_logprobs=9)
    ok = client.chat.completions.create(model=model, messages=QUESTION, logprobs=True, top_logprobs=8,
                                        max_tokens=2)
    assert len(ok.choices[0].logprobs.content[0].top_logprobs) == 8


@pytest.mark.parametrize("flags,message", [
    (["--tool-call-parser", "nope"], ("unknown tool-call parser 'nope'; known: deepseek_v3, deepseek_v31, "
                                      "hermes, llama3_json, qwen3")),
    (["--reasoning-parser", "r2"], "unknown reasoning parser 'r2'; known: deepseek_r1, qwen3"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
])
def test_bad_parser_flags_fail_at_start(flags, message, capsys):
    """`ksana-llm serve` stops with exit code 2 and the known names, before loading any model."""
    from ksana_llm.cli import main

    assert main(["serve", "--port", "1", "--model", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err
