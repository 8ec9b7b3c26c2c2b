"""OpenAI's Responses API on a real server process (SmolLM2), driven by the official `openai`
client (`client.responses.create / stream / retrieve / delete`): texts equal transformers' greedy
replies to the same conversation, conversations continue through `previous_response_id`, the
streamed events are the ones the SDK's accumulator accepts, and what the chat route also does
(logprobs, JSON schemas, tools) answers as the chat route answers the same messages."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from tests.server_process import server_fixture

QUESTION = "What is the capital of France?"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]


server = server_fixture(["--num-device-blocks", "256", "--max-model-len", "2048",
                         "--max-stored-responses", "4"])


def hf_reply(hf_model, tokenizer, messages: list[dict], max_new_tokens: int,
             tools: list[dict] | None = None) -> tuple[str, int, int]:
    """transformers' greedy reply to `messages` under the model's chat template: (text, prompt
    tokens, generated tokens)."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             tools=tools)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, len(ids):].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), len(ids), len(new)


def test_a_reply_equals_transformers(client, model_name, hf_default_model, default_model):
    r = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                max_output_tokens=24)
    text, prompt_tokens, new_tokens = hf_reply(
        hf_default_model, default_model.tokenizer, [{"role": "user", "content": QUESTION}], 24)
    assert (r.object, r.status, r.model, r.error) == ("response", "completed", model_name, None)
    assert r.id.startswith("resp_") and "Paris" in text
    assert r.created_at <= r.completed_at <= time.time()  # OpenAI's: set once completed
    assert r.output_text == text
    (item,) = r.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    assert item.id.startswith("msg_") and item.content[0].type == "output_text"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (prompt_tokens, new_tokens)
    assert r.usage.total_tokens == prompt_tokens + new_tokens
    # Input items with text parts are the same conversation.
    parts = client.responses.create(model=model_name, temperature=0, max_output_tokens=24, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert parts.output_text == text
    # The same prompt again: its full 16-token blocks come from the prefix cache.
    cached = parts.usage.input_tokens_details.cached_tokens
    assert cached == prompt_tokens // 16 * 16 > 0


def test_instructions_and_previous_response_continue_a_conversation(
        client, model_name, hf_default_model, default_model):
    """`instructions` is the system message; `previous_response_id` puts the earlier input and
    output first (not the earlier instructions). Stored answers can be read back and deleted."""
    tokenizer = default_model.tokenizer
    first = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                    max_output_tokens=24, instructions="You are a geography tutor.")
    conversation = [{"role": "system", "content": "You are a geography tutor."},
                    {"role": "user", "content": QUESTION}]
    assert first.output_text == hf_reply(hf_default_model, tokenizer, conversation, 24)[0]
    second = client.responses.create(model=model_name, input="And of Germany?", temperature=0,
                                     max_output_tokens=24, previous_response_id=first.id,
                                     instructions="Answer in one sentence.")
    expected = hf_reply(hf_default_model, tokenizer, [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Germany?"}], 24)[0]
    assert second.output_text == expected and second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=model_name, input="x", previous_response_id=first.id)
    assert missing.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=model_name, input=QUESTION, store=False,
                                       max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_list_the_conversation(client, server, model_name):
    """`GET /v1/responses/{id}/input_items` (the SDK's `responses.input_items.list`): the items a
    response answered (the earlier turns' inputs and outputs, then its own input), with ids, in
    either order, paged by the SDK's cursor (`after`) and by `before`."""
    first = client.responses.create(model=model_name, input=QUESTION, max_output_tokens=4)
    second = client.responses.create(
        model=model_name, previous_response_id=first.id, max_output_tokens=4,
        input=[{"role": "user", "content": "And of Germany?"},
               {"type": "message", "role": "user", "id": "msg_mine",
                "content": [{"type": "input_text", "text": "Briefly."}]}])
    items = client.responses.input_items.list(second.id, order="asc", limit=100).data
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"),
                                                  ("message", "user"), ("message", "user")]
    assert [i.content[0].text for i in items] == [QUESTION, first.output_text, "And of Germany?",
                                                  "Briefly."]
    assert items[1].id == first.output[0].id and items[3].id == "msg_mine"
    assert len({i.id for i in items}) == 4
    newest_first = client.responses.input_items.list(second.id).data  # default: desc, 20
    assert [i.id for i in newest_first] == [i.id for i in reversed(items)]
    # The SDK follows `after` from page to page.
    assert [i.id for i in client.responses.input_items.list(second.id, order="asc", limit=1)] \
        == [i.id for i in items]
    url = f"{server.base_url}/responses/{second.id}/input_items"
    page = httpx.get(url, params={"order": "asc", "limit": 2, "before": items[3].id}).json()
    assert [i["id"] for i in page["data"]] == [items[1].id, items[2].id] and page["has_more"]
    assert (page["first_id"], page["last_id"]) == (items[1].id, items[2].id)
    page = httpx.get(url, params={"order": "desc", "after": items[2].id}).json()
    assert [i["id"] for i in page["data"]] == [items[1].id, items[0].id]
    assert not page["has_more"]
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                          ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        response = httpx.get(url, params=params)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert httpx.get(f"{server.base_url}/responses/resp_nope/input_items").status_code == 404


def test_truncation_auto_drops_the_oldest_turns(client, model_name, hf_default_model,
                                                default_model):
    """A conversation longer than the context (2,048 tokens here) is a 400 by default; with
    `truncation: "auto"` its oldest turn goes (whole), and the answer is transformers' answer
    to what is left; `instructions` and the leading system message stay (OpenAI drops items in
    the middle). The stored conversation keeps every item."""
    long_a = "The river flows through the quiet valley at dawn. " * 110
    long_b = "Mountains rise above the old town near the sea. " * 110
    conversation = [{"role": "system", "content": "Be concise."},
                    {"role": "user", "content": long_a}, {"role": "assistant", "content": "Noted."},
                    {"role": "user", "content": long_b}, {"role": "assistant", "content": "Noted."},
                    {"role": "user", "content": QUESTION}]
    kwargs = dict(model=model_name, input=conversation, temperature=0, max_output_tokens=12,
                  instructions="Answer briefly.")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**kwargs)
    assert refused.value.body["code"] == "context_length_exceeded"
    # Worded in the Responses API's own terms, not the chat route's it runs on.
    assert "in the input, 12 in max_output_tokens" in refused.value.body["message"]
    assert "messages" not in refused.value.body["message"]
    response = client.responses.create(**kwargs, truncation="auto")
    text, prompt_tokens, _ = hf_reply(hf_default_model, default_model.tokenizer,
                                      [{"role": "system", "content": "Answer briefly."},
                                       conversation[0], *conversation[3:]], 12)
    assert response.output_text == text and response.truncation == "auto"
    assert response.usage.input_tokens == prompt_tokens
    assert len(client.responses.input_items.list(response.id, limit=100).data) == 6
    with pytest.raises(openai.BadRequestError):  # the last turn alone does not fit
        client.responses.create(model=model_name, input=long_a * 3, truncation="auto")


def test_streamed_events(client, model_name):
    """The SDK's stream helper accepts the events (it checks every item's identity) and ends with
    the non-streamed answer; deltas add up to the text; sequence numbers count from 0. An answer
    cut by max_output_tokens ends with `response.incomplete`."""
    done = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                   max_output_tokens=40)
    with client.responses.stream(model=model_name, input=QUESTION, temperature=0,
                                 max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == done.output_text and final.status == done.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == done.output_text and len(deltas) > 1
    assert final.usage.output_tokens == done.usage.output_tokens

    cut = list(client.responses.create(model=model_name, input=QUESTION, max_output_tokens=3,
                                       temperature=0, stream=True))
    last = cut[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[0].status == "incomplete"
    assert last.response.completed_at is None and events[0].response.completed_at is None
    same = client.responses.create(model=model_name, input=QUESTION, max_output_tokens=3,
                                   temperature=0)
    assert (same.status, same.output_text) == ("incomplete", last.response.output_text)


def test_logprobs_equal_the_chat_routes(client, model_name):
    r = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                max_output_tokens=8, include=["message.output_text.logprobs"],
                                top_logprobs=2)
    chat = client.chat.completions.create(model=model_name, temperature=0, max_tokens=8,
                                          messages=[{"role": "user", "content": QUESTION}],
                                          logprobs=True, top_logprobs=2)
    ours = r.output[0].content[0].logprobs
    theirs = chat.choices[0].logprobs.content
    assert [e.token for e in ours] == [e.token for e in theirs]
    assert [e.logprob for e in ours] == pytest.approx([e.logprob for e in theirs], abs=1e-5)
    assert all(len(e.top_logprobs) == 2 for e in ours)
    # Without the `include`, `top_logprobs` alone returns none (OpenAI's and vLLM's rule).
    plain = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                    max_output_tokens=8, top_logprobs=2)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs == 2
    streamed = list(client.responses.create(
        model=model_name, input=QUESTION, temperature=0, max_output_tokens=8, stream=True,
        include=["message.output_text.logprobs"], top_logprobs=2))
    # Deltas carry their tokens' logprobs; the done event has them all (the end-of-turn token
    # adds no text, so no delta carries it).
    delta_logprobs = [lp for e in streamed if e.type == "response.output_text.delta"
                      for lp in e.logprobs]
    (text_done,) = [e for e in streamed if e.type == "response.output_text.done"]
    assert [lp.token for lp in text_done.logprobs] == [e.token for e in ours]
    assert [lp.token for lp in delta_logprobs] == [e.token for e in ours][:len(delta_logprobs)]
    assert len(delta_logprobs) >= len(ours) - 1


def test_json_schema_output(client, model_name):
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(model=model_name, input="Name the capital of France as JSON.",
                                temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "capital",
                                                 "schema": schema, "strict": True}})
    assert set(json.loads(r.output_text)) == {"city"}


def test_function_calls_and_their_outputs(client, model_name):
    """A named tool_choice gives one function_call item whose arguments fit the schema; its
    output sent back (function_call_output, continuing the response) is answered as the chat
    route answers the same messages."""
    r = client.responses.create(model=model_name, input="What is the weather in Paris?",
                                tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                                temperature=0, max_output_tokens=40)
    (call,) = r.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    follow = client.responses.create(
        model=model_name, previous_response_id=r.id, tools=TOOLS, tool_choice="none",
        temperature=0, max_output_tokens=24,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "22 C and sunny"}])
    chat = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=24, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                 if k != "type"}}],
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": "get_weather", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "22 C and sunny"}])
    assert follow.output_text == chat.choices[0].message.content
    # The continued conversation holds this call only: an output for another one is refused.
    with pytest.raises(openai.BadRequestError, match="call_id call_other"):
        client.responses.create(model=model_name, previous_response_id=r.id, input=[
            {"type": "function_call_output", "call_id": "call_other", "output": "x"}])


def test_items_the_conversation_holds_are_not_taken_twice(client, model_name):
    """Feeding a response's output back beside `previous_response_id` (which holds it) is a
    400 naming the item, as OpenAI answers; the same items without the id chain are fine."""
    first = client.responses.create(model=model_name, input=QUESTION, max_output_tokens=3)
    again = [item.model_dump(exclude_none=True) for item in first.output]
    duplicate = f"Duplicate item found with id {again[0]['id']}"
    with pytest.raises(openai.BadRequestError, match=duplicate):
        client.responses.create(model=model_name, previous_response_id=first.id,
                                input=again + [{"role": "user", "content": "More."}],
                                max_output_tokens=2)
    fresh = client.responses.create(model=model_name, max_output_tokens=2, input=[
        {"role": "user", "content": QUESTION}, *again, {"role": "user", "content": "More."}])
    ids = [item.id for item in client.responses.input_items.list(fresh.id).data]
    assert again[0]["id"] in ids and len(ids) == len(set(ids))


def test_what_the_sdk_sends_by_default_is_accepted(client, model_name):
    """Nulls the SDK's typed params carry (a tool's `strict`, `description`), fields of
    OpenAI's hosted features (`defer_loading`), `store: null`, and a continuation with no new
    input."""
    tool = {**TOOLS[0], "strict": None, "description": None, "defer_loading": False}
    first = client.responses.create(model=model_name, input=QUESTION, tools=[tool],
                                    tool_choice="none", max_output_tokens=4, store=None,
                                    stream=None, max_tool_calls=3)
    assert first.status in ("completed", "incomplete")
    follow = client.responses.create(model=model_name, previous_response_id=first.id,
                                     max_output_tokens=4)
    assert follow.previous_response_id == first.id and follow.output


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input.0.content.0"),
    ({"input": [{"type": "web_search_call"}]}, 400, "input.0.type"),
    ({"input": [{"role": "critic", "content": "x"}]}, 400, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input.0.call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}], "tool_choice": "none"},
     400, "tools.0.name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "other"}},
     400, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, 400,
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     400, "text.format.name"),  # OpenAI requires the name
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400,
     "input.0.content.0.text"),
    ({"input": "x", "background": True, "store": False}, 400, "background"),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),  # 16 at most
    ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata.k"),
    ({"input": "x", "include": ["file_search_call.results"]}, 400, "include"),
    ({"input": "x", "temperature": 3}, 400, "temperature"),
    ({"input": "x", "surprise": 1}, 400, "surprise"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
    ({"input": "x", "priority": -1}, 400, "priority"),  # a FIFO server
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    # An output answers a call made before it (OpenAI: "No tool call found ...").
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "call_nope", "output": "1"}]},
     400, "input.1"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     400, "input.0"),
    ({"input": "x", "model": "no-such-model"}, 404, "model"),
    # An item id names one item (OpenAI: "Duplicate item found with id ...").
    ({"input": [{"id": "msg_1", "role": "user", "content": "x"},
                {"id": "msg_1", "role": "user", "content": "y"}]}, 400, "input.1"),
])
def test_bad_requests_name_the_parameter(server, body, status, param):
    response = httpx.post(server.base_url + "/responses", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_unknown_ids_are_404(server):
    for method in ("GET", "DELETE"):
        response = httpx.request(method, server.base_url + "/responses/resp_nope")
        assert response.status_code == 404 and response.json()["error"]["code"] == \
            "response_not_found"


def test_reasoning_effort_values_and_the_text_echo(client, model_name):
    """The client's own `reasoning.effort` values reach the template (xhigh and max too), and
    the echoed `text` always holds its `format`, as OpenAI fills it in."""
    for effort in ("xhigh", "max"):
        out = client.responses.create(model=model_name, input=QUESTION, max_output_tokens=2,
                                      reasoning={"effort": effort})
        assert out.reasoning.effort == effort
    out = client.responses.create(model=model_name, input=QUESTION, max_output_tokens=2,
                                  text={"verbosity": "low"})
    assert out.text.format.type == "text" and out.text.verbosity == "low"


def test_a_response_reports_the_sampling_it_ran_with(default_model):
    """A request that leaves temperature / top_p out runs with the model's defaults
    (--override-generation-config, generation_config.json); the response says those, not
    OpenAI's 1.0 (the stored copy too), and one given outright is reported as given."""
    import asyncio

    import ksana_llm as kt
    from ksana_llm.server.app import build_app
    from ksana_llm.server.sampling_defaults import SamplingDefaults

    engine = kt.Engine(default_model, num_device_blocks=64)
    app = build_app(engine, served_model_name="m",
                    sampling_defaults=SamplingDefaults(temperature=0.5, top_p=0.9))

    async def main() -> list[dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:
            left_out = (await http.post("/v1/responses", json={
                "input": "Hi", "max_output_tokens": 2})).json()
            stored = (await http.get(f"/v1/responses/{left_out['id']}")).json()
            given = (await http.post("/v1/responses", json={
                "input": "Hi", "max_output_tokens": 2, "temperature": 0.0})).json()
            return [left_out, stored, given]

    try:
        left_out, stored, given = asyncio.run(main())
    finally:
        engine.shutdown()
    assert (left_out["temperature"], left_out["top_p"]) == (0.5, 0.9)
    assert (stored["temperature"], stored["top_p"]) == (0.5, 0.9)
    assert (given["temperature"], given["top_p"]) == (0.0, 0.9)
