"""tool_choice "required" and a named function (the call array and the named call streamed
under their grammar), and the chunks a streamed choice sends for its calls: each call named
once per chunk, as OpenAI streams them."""

from __future__ import annotations

import json

import pytest

from ksana_llm.server.chat_output import ChoiceOutputParser
from ksana_llm.server.tool_parsers import JsonCallSequenceStream, ParsedOutput, collect, get_tool_parser
from ksana_llm.server.tools import NamedCallStream, plan_tools, required_schema
from tests.tool_parser_harness import CALLS, NESTED, WEATHER, chunkings, stream_in


def test_required_array_and_named_streams():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n, _ in CALLS]
    text = json.dumps([{"name": n, "parameters": a} for n, a in CALLS], ensure_ascii=False)
    required = plan_tools(tools, "required", parallel_tool_calls=None, auto_enabled=False, parser=None)
    stream = required.stream()
    final = collect([stream.feed(text), stream.finish()])
    assert [(c.name, json.loads(c.arguments)) for c in final.tool_calls] == CALLS
    for sizes in chunkings(text, 30, seed=2):
        assert collect(stream_in(JsonCallSequenceStream(open="[", separator=",", close="]"), text,
                               sizes)) == final
    args = json.dumps(WEATHER[1])
    # A key that is not JSON ends the calls without raising (the call already named stays).
    bad = '[{"name": "f", "parameters": {}, "\\z": 1}]'
    for sizes in chunkings(bad, 10, seed=5):
        got = collect(stream_in(JsonCallSequenceStream(open="[", separator=",", close="]"), bad, sizes))
        assert [(c.name, c.arguments) for c in got.tool_calls] == [("f", "{}")]
    named = collect(stream_in(NamedCallStream("get_weather"), args, [3, 5, 1]))
    assert named == ParsedOutput(None, [named.tool_calls[0]])
    assert named.tool_calls[0].name == "get_weather" and named.tool_calls[0].arguments == args


def test_required_calls_cut_off_give_no_content():
    """tool_choice "required" constrains the output to a call array, so an output cut off by
    max_tokens is never content: a call cut before its arguments is dropped, one cut inside them
    keeps what came (OpenAI sends no content beside required calls)."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n, _ in CALLS]
    text = json.dumps([{"name": n, "parameters": a} for n, a in CALLS], ensure_ascii=False)
    required = plan_tools(tools, "required", parallel_tool_calls=None, auto_enabled=False, parser=None)
    first_end = text.index("}}") + 2  # after the first call's object
    second_named = text.index(f'"{NESTED[0]}"') + len(NESTED[0]) + 2  # after its name's quote
    for cut in range(0, len(text)):
        stream = required.stream()
        got = collect([stream.feed(text[:cut]), stream.finish()])
        assert not got.content, (cut, got)
        assert [c.name for c in got.tool_calls] == [n for n, _ in CALLS][:len(got.tool_calls)]
        if cut > first_end:
            assert got.tool_calls[0].name == WEATHER[0]
        if cut >= second_named:  # the second call's name came: it is a call, arguments or not
            assert [c.name for c in got.tool_calls][:2] == [WEATHER[0], NESTED[0]], cut
    # Cut before its arguments came: the call has none yet, not "{}" (a call taking none).
    stream = required.stream()
    got = collect([stream.feed(text[:second_named] + ', "param'), stream.finish()])
    assert [(c.name, c.arguments) for c in got.tool_calls][1] == (NESTED[0], "")
    # Without the constraint (a parser's "auto" output), the same fragment is the answer's text.
    loose = JsonCallSequenceStream(open="[", separator=",", close="]")
    assert collect([loose.feed('[{"name":'), loose.finish()]).content == '[{"name":'


def test_required_schema_shape():
    import jsonschema

    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
             {"type": "function", "function": {"name": "b"}}]
    schema = required_schema(tools, parallel=True)
    jsonschema.validate([{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}], schema)
    for bad in ([], [{"name": "a", "parameters": {"x": "1"}}], [{"name": "c", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(tools, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {}}] * 2, single)


def test_the_finishing_chunk_names_each_call_once():
    """The last text and the parser's finishing tail go out in one chunk: a call completed by
    the finish (no end tag, no arguments) is one delta there, not two of one index."""
    parser = ChoiceOutputParser(None, get_tool_parser("hermes").stream())
    parser.feed('<tool_call>{"name": "noar')
    last = parser.feed('gs"}').then(parser.finish())
    message = parser.delta_message(last)
    assert [(c.index, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (0, "noargs", "{}")]


def test_one_chunk_names_each_call_once():
    """A call parsed whole in one piece (its name, then the "{}" of a call without arguments)
    is one tool-call delta in the chunk, as OpenAI streams it."""
    parser = ChoiceOutputParser(None, get_tool_parser("hermes").stream())
    text = '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    delta = parser.feed(text)
    message = parser.delta_message(delta)
    assert [(c.index, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (0, "get_time", "{}"), (1, "f", '{"a": 1}')]
    assert all(c.id for c in message.tool_calls)
