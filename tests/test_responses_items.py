"""How one choice's text becomes Responses output items, streamed and not, without a model:
reasoning (a `--reasoning-parser`), text and tool calls (a `--tool-call-parser`) fed in pieces
give reasoning, message and function_call items whose events the `openai` SDK's own stream
accumulator takes, and which equal the non-streamed items built from the whole text. Also the
translation of input items to chat messages and of chat errors to Responses parameters."""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from ksana_llm.server.chat_output import ChoiceOutputParser
from ksana_llm.server.errors import APIError, bad_request
from ksana_llm.server.reasoning_parsers import get_reasoning_parser
from ksana_llm.server.responses_events import OutputItems, SseEvents
from ksana_llm.server.responses_protocol import input_messages, responses_error
from ksana_llm.server.tool_parsers import get_tool_parser

PIECES = ["<think>Check the", " weather.</think>Let me look.",
          '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>']


def make_parser(reasoning: bool = True) -> ChoiceOutputParser:
    return ChoiceOutputParser(get_reasoning_parser("deepseek_r1").stream() if reasoning else None,
                              get_tool_parser("hermes").stream())


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def stream_events(pieces: list[str], reasoning: bool = True
                  ) -> tuple[list[dict], list[dict], ChoiceOutputParser]:
    """What the route streams for a choice whose text arrives in `pieces` (the last one with
    the finish): every event's payload, between a created and a completed event, and the
    items."""
    parser = make_parser(reasoning)
    events = SseEvents()
    items = OutputItems(events, parser)
    response = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m",
                "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "status": "in_progress"}
    chunks = [events("response.created", response=response)]
    for piece in pieces:
        chunks.extend(items.add(parser.feed(piece), []))
    chunks.extend(items.add(parser.finish(), []))
    chunks.extend(items.finish("completed"))
    chunks.append(events("response.completed",
                         response={**response, "status": "completed", "output": items.output}))
    payloads = [json.loads(chunk.split("data: ", 1)[1]) for chunk in chunks]
    assert [c.split("\n", 1)[0] for c in chunks] == [f"event: {p['type']}" for p in payloads]
    return payloads, items.output, parser


def sdk_final(payloads: list[dict]):
    """The response the `openai` SDK's stream accumulator builds from the events (it checks
    every item's identity on the way)."""
    state = ResponseStreamState(input_tools=[], text_format=omit)
    handled = [event for payload in payloads
               for event in state.handle_event(construct_type(type_=ResponseStreamEvent,
                                                              value=payload))]
    assert handled[-1].type == "response.completed"
    return handled[-1].response


def test_streamed_items_are_accepted_by_the_sdk_and_do_not_depend_on_the_pieces():
    payloads, streamed, parser = stream_events(PIECES)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    final = sdk_final(payloads)
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me look."
    assert final.output[0].content[0].text == "Check the weather."
    assert json.loads(final.output[2].arguments) == {"city": "Paris"}
    assert final.output[2].call_id == parser.call_id(0)
    # The non-streamed answer goes through the same code with the whole text in one piece.
    _, whole, _ = stream_events(["".join(PIECES)])
    assert _without_ids(streamed) == _without_ids(whole)
    # ... and says what the chat route's parser says of the whole text.
    chat = make_parser()
    message = chat.message([chat.feed("".join(PIECES)), chat.finish()])
    assert (streamed[0]["content"][0]["text"], streamed[1]["content"][0]["text"]) == \
        (message.reasoning_content, message.content)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
        [(streamed[2]["name"], streamed[2]["arguments"])]


@pytest.mark.parametrize("pieces", [
    # A call's last arguments and the text after it in one delta.
    ['Hi <tool_call>{"name": "f", "arguments": {"a": ', '1}}</tool_call>\nDone.'],
    ['Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', '\nDone.'],
    ['Hi ', '<tool_call>{"name": "f", ', '"arguments": {"a": 1}}</tool_call>', '\n', 'Done.'],
])
def test_calls_keep_their_arguments_whatever_the_deltas(pieces):
    """However the text is cut, the call keeps all its arguments and the text around it is
    all there. Streamed, text after the call is a message after it; in one piece (the
    non-streamed answer) the parser hands both texts over together, before the call."""
    payloads, items, _ = stream_events(pieces, reasoning=False)
    final = sdk_final(payloads)
    assert [item.type for item in final.output] == ["message", "function_call", "message"]
    assert json.loads(items[1]["arguments"]) == {"a": 1}
    _, whole, _ = stream_events(["".join(pieces)], reasoning=False)
    assert [item["type"] for item in whole] == ["message", "function_call"]
    assert whole[1]["arguments"] == items[1]["arguments"]

    def words(item_list: list[dict]) -> list[str]:
        return " ".join(i["content"][0]["text"] for i in item_list if i["type"] == "message"
                        ).split()

    assert words(items) == words(whole) == ["Hi", "Done."]


def test_an_empty_answer_is_one_empty_message():
    payloads, items, _ = stream_events([], reasoning=False)
    assert [(i["type"], i["content"][0]["text"]) for i in items] == [("message", "")]
    assert sdk_final(payloads).output_text == ""


def test_input_items_become_chat_messages():
    messages = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                         {"type": "input_text", "text": "!"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Calling.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": "two"},
    ])
    assert [(m.role, m.content) for m in messages] == [
        ("developer", "Be brief."), ("user", "Hi!"), ("assistant", "Calling."),
        ("tool", "one"), ("tool", "two")]
    assistant = messages[2]
    assert assistant.reasoning_content == "think"
    assert [c["id"] for c in assistant.tool_calls] == ["call_1", "call_2"]
    assert [m.tool_call_id for m in messages[3:]] == ["call_1", "call_2"]
    # A call with no text before it is an assistant turn of its own.
    (call_only,) = input_messages([{"type": "function_call", "call_id": "c", "name": "f",
                                    "arguments": "{}"}])
    assert (call_only.role, call_only.content, len(call_only.tool_calls)) == ("assistant", None, 1)


@pytest.mark.parametrize("chat_param, ours", [
    ("messages", "input"), ("messages.3.content", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("tools.2.function.parameters", "tools.2.parameters"), ("tool_choice", "tool_choice"),
])
def test_chat_errors_name_the_responses_parameter(chat_param, ours):
    renamed = responses_error(bad_request(f"`{chat_param}` is wrong.", param=chat_param))
    assert isinstance(renamed, APIError) and renamed.status == 400
    assert renamed.param == ours and renamed.message == f"`{ours}` is wrong."


def test_a_reasoning_item_belongs_to_the_assistant_turn_right_after_it():
    messages = input_messages([
        {"role": "user", "content": "a"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "R"}]},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"}])
    assert messages[-1].reasoning_content is None


def test_a_messages_logprobs_are_its_texts_tokens():
    """Logprobs of reasoning tokens (`<think>`, its text, `</think>` and the blank line after)
    are not the message's: one entry per fed piece, the message keeps those of its own text."""
    pieces = ["<think>", "Need", " to think", "</think>", "\n\n", "Paris", "."]
    parser = ChoiceOutputParser(get_reasoning_parser("qwen3").stream(False), None)
    items = OutputItems(SseEvents(), parser)
    for piece in pieces:
        list(items.add(parser.feed(piece), [{"token": piece, "bytes": [], "logprob": -0.5,
                                             "top_logprobs": []}]))
    list(items.add(parser.finish(), []))
    list(items.finish("completed"))
    (message,) = [item for item in items.output if item["type"] == "message"]
    assert message["content"][0]["text"] == "Paris."
    assert [lp["token"] for lp in message["content"][0]["logprobs"]] == ["Paris", "."]
