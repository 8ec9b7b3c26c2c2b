"""Tool-call parsers: each format, non-streamed and streamed in random chunkings.

Model outputs are built here from known calls (name + arguments) in each model family's format;
the parser must give those calls back (arguments as JSON text that loads to the same object), the
content around them, and -- streamed -- exactly the non-streamed result, with names before
arguments and no half-written tag ever sent as content.
"""

from __future__ import annotations

import json

import pytest

from ksana_llm.server.chat_output import ChoiceOutputParser
from ksana_llm.server.reasoning_parsers import get_reasoning_parser
from ksana_llm.server.tool_parsers import TOOL_PARSERS, collect, get_tool_parser
from tests.tool_parser_harness import (
    CALLS,
    EMPTY,
    NESTED,
    WEATHER,
    check_case,
    check_stream,
    chunkings,
    scans_streaming,
    stream_in,
)


def hermes(content: str, calls: list, pretty: bool = False) -> str:
    blocks = []
    for name, args in calls:
        body = json.dumps({"name": name, "arguments": args}, indent=2 if pretty else None,
                          ensure_ascii=False)
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    return content + ("\n" if content and blocks else "") + "\n".join(blocks)


def llama3(calls: list, tag: bool) -> str:
    text = "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    return ("<|python_tag|>" if tag else "") + text


def deepseek_v3(content: str, calls: list) -> str:
    parts = [f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n"
             f"{json.dumps(a, ensure_ascii=False)}\n```<｜tool▁call▁end｜>" for n, a in calls]
    return content + "<｜tool▁calls▁begin｜>" + "\n".join(parts) + "<｜tool▁calls▁end｜>"


def deepseek_v31(content: str, calls: list) -> str:
    parts = [f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a, ensure_ascii=False)}<｜tool▁call▁end｜>"
             for n, a in calls]
    return content + "<｜tool▁calls▁begin｜>" + "".join(parts) + "<｜tool▁calls▁end｜>"


def mistral_v3(content: str, calls: list) -> str:
    """Tokenizers before v11: one JSON array after the token, each call with a 9-character id."""
    body = json.dumps([{"name": n, "arguments": a, "id": f"{i:09d}"} for i, (n, a) in enumerate(calls)],
                      ensure_ascii=False)
    return f"{content}[TOOL_CALLS] {body}"


def mistral_v11(content: str, calls: list, call_ids: bool = False) -> str:
    """v11 and later: the token before each call, `name[CALL_ID]id[ARGS]{...}`."""
    return content + "".join(f"[TOOL_CALLS]{n}" + (f"[CALL_ID]{i:09d}" if call_ids else "")
                             + f"[ARGS]{json.dumps(a, ensure_ascii=False)}"
                             for i, (n, a) in enumerate(calls))


def kimi_k2(content: str, calls: list) -> str:
    parts = [f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>"
             f"{json.dumps(a, ensure_ascii=False)}<|tool_call_end|>" for i, (n, a) in enumerate(calls)]
    return content + "<|tool_calls_section_begin|>" + "".join(parts) + "<|tool_calls_section_end|>"


def internlm(content: str, call: tuple) -> str:
    body = json.dumps({"name": call[0], "parameters": call[1]}, ensure_ascii=False)
    return f"{content}<|action_start|><|plugin|>\n{body}<|action_end|>"


def granite(calls: list, tag: str = "<tool_call>") -> str:
    return tag + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


def tagged_json(start: str, end: str, calls: list, joiner: str | None = None) -> str:
    """Call objects between `start` and `end`: a JSON array, or (`joiner`) one after the other."""
    objects = [{"name": n, "arguments": a} for n, a in calls]
    body = json.dumps(objects, ensure_ascii=False) if joiner is None else \
        joiner.join(json.dumps(o, ensure_ascii=False) for o in objects)
    return start + body + end


# (parser, model text, expected content, expected calls)
CASES = [
    ("hermes", hermes("Let me look that up.", CALLS), "Let me look that up.", CALLS),
    ("hermes", hermes("", [WEATHER], pretty=True), None, [WEATHER]),
    ("hermes", "The weather is fine, no <tool needed. 3 < 4 > 2.", "The weather is fine, no <tool needed. 3 < 4 > 2.", []),
    ("hermes", hermes("", [WEATHER]) + "\nAnything else?", "Anything else?", [WEATHER]),
    # Not a call after all (no name): the region is content, tags included.
    ("hermes", "<tool_call>\nnot json\n</tool_call> ok", "<tool_call>\nnot json\n</tool_call> ok", []),
    # Arguments before the name.
    ("hermes", '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
    # Arguments JSON-encoded a second time (some models do): decoded.
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
     None, [("get_weather", {"city": "Rome"})]),
    ("qwen3", hermes("I'll call two tools.", [WEATHER, EMPTY]), "I'll call two tools.", [WEATHER, EMPTY]),
    ("llama3_json", llama3(CALLS, tag=True), None, CALLS),
    ("llama3_json", llama3([WEATHER], tag=False), None, [WEATHER]),
    ("llama3_json", "  The capital of France is Paris.", "  The capital of France is Paris.", []),
    # JSON that is not a call stays content, whole.
    ("llama3_json", '{"answer": 42, "why": "because"}', '{"answer": 42, "why": "because"}', []),
    ("deepseek_v3", deepseek_v3("Checking both.", [WEATHER, NESTED]), "Checking both.", [WEATHER, NESTED]),
    ("deepseek_v3", deepseek_v3("", [EMPTY]), None, [EMPTY]),
    ("deepseek_v31", deepseek_v31("On it.", [WEATHER, EMPTY]), "On it.", [WEATHER, EMPTY]),
    # Malformed JSON never raises: a name or key that string_end accepts but JSON does not
    # (a raw tab, a bad escape) makes the region content, or ends a call already named.
    ("hermes", '<tool_call>{"name": "get\tweather", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "get\tweather", "arguments": {}}</tool_call>', []),
    ("qwen3", '<tool_call>{"name": "f", "arguments": {}, "\\q": 1}</tool_call>', None, [("f", {})]),
    ("llama3_json", '{"name": "f\\y", "parameters": {}}', '{"name": "f\\y", "parameters": {}}', []),
    # A string that is not JSON inside is not decoded: the literal itself is the arguments.
    ("hermes", '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', None, [("f", "not json")]),
    # A call without arguments gets "{}"; for Llama 3, an object without them is an answer.
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", {})]),
    ("llama3_json", '{"name": "John", "age": 30}', '{"name": "John", "age": 30}', []),
    ("deepseek_v31", "<｜tool▁call▁begin｜>f<｜tool▁sep｜><｜tool▁call▁end｜>", None, [("f", {})]),
    # Several calls between one pair of tags, one after the other or as an array: each a call.
    ("hermes", "<tool_call>\n" + "\n".join(json.dumps({"name": n, "arguments": a}) for n, a in CALLS)
     + "\n</tool_call>", None, CALLS),
    ("qwen3", "<tool_call>" + json.dumps([{"name": n, "arguments": a} for n, a in CALLS])
     + "</tool_call>\nDone.", "Done.", CALLS),
    ("mistral", mistral_v3("", CALLS), None, CALLS),
    ("mistral", mistral_v3("Let me check.", [WEATHER]), "Let me check.", [WEATHER]),
    ("mistral", mistral_v11("", CALLS), None, CALLS),
    ("mistral", mistral_v11("On it.", [WEATHER, EMPTY], call_ids=True), "On it.", [WEATHER, EMPTY]),
    # The first v11 releases: the arguments right after the name, no [ARGS].
    ("mistral", "[TOOL_CALLS]get_weather" + json.dumps(WEATHER[1]), None, [WEATHER]),
    ("mistral", "Lists look like [1, 2] or [TOOL] here.", "Lists look like [1, 2] or [TOOL] here.", []),
    # No call after the token (no name, or not one a function may have): content, token included.
    ("mistral", "[TOOL_CALLS]Sorry, I {cannot}.", "[TOOL_CALLS]Sorry, I {cannot}.", []),
    ("llama4_json", llama3([WEATHER], tag=False), None, [WEATHER]),
    ("kimi_k2", kimi_k2("Checking.", CALLS), "Checking.", CALLS),
    ("kimi_k2", "No tools needed: <|tool_ is not a tag.", "No tools needed: <|tool_ is not a tag.", []),
    ("internlm", internlm("Let me look.", NESTED), "Let me look.", [NESTED]),
    # A code-interpreter action is no function call: content.
    ("internlm", "<|action_start|><|interpreter|>\nprint(1)<|action_end|>",
     "<|action_start|><|interpreter|>\nprint(1)<|action_end|>", []),
    ("granite", granite(CALLS), None, CALLS),
    ("granite", granite([WEATHER], "<|tool_call|>") + " Done.", "Done.", [WEATHER]),
    ("granite", "[1, 2] are the numbers.", "[1, 2] are the numbers.", []),
    ("longcat", "On it." + "".join(tagged_json("<longcat_tool_call>", "</longcat_tool_call>", [c], "")
                                   for c in CALLS), "On it.", CALLS),
    ("longcat", hermes("", [WEATHER]), hermes("", [WEATHER]), []),  # hermes's tags are text to it
    ("jamba", "Checking." + tagged_json("<tool_calls>", "</tool_calls>", CALLS), "Checking.", CALLS),
    ("jamba", tagged_json("<tool_calls>", "</tool_calls>", [WEATHER]) + "\nDone.", "Done.", [WEATHER]),
    ("minimax", "Let me search.\n" + tagged_json("<tool_calls>\n", "\n</tool_calls>", CALLS, "\n"),
     "Let me search.", CALLS),
    ("phi4_mini_json", "functools" + json.dumps([{"name": n, "arguments": a} for n, a in CALLS]), None, CALLS),
    ("phi4_mini_json", "The tools are [a, b].", "The tools are [a, b].", []),
    # `functools` is a word a plain answer may start with: it stays in the content.
    ("phi4_mini_json", "functools.partial binds arguments.", "functools.partial binds arguments.", []),
    # After the array's end everything is content, a separator and an object too.
    ("phi4_mini_json", "functools" + json.dumps([{"name": n, "arguments": a} for n, a in [WEATHER]])
     + ', {"name": "g", "arguments": {}}', ', {"name": "g", "arguments": {}}', [WEATHER]),
    # A call, then an object that is no call, between one pair of tags: the rest is content.
    ("jamba", '<tool_calls>[{"name": "f", "arguments": {}}, {"x": 1}]</tool_calls>',
     '<tool_calls>{"x": 1}]</tool_calls>', [("f", {})]),
    # An [ARGS] inside the arguments of the `name{...}` form is text (streamed or not).
    ("mistral", '[TOOL_CALLS]f{"a": "[ARGS]"}', None, [("f", {"a": "[ARGS]"})]),
]


@pytest.mark.parametrize("name,text,content,calls", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_extract_and_stream(name, text, content, calls):
    check_case(name, text, content, calls)


def test_arguments_stream_before_the_call_ends():
    parser = get_tool_parser("hermes")
    text = hermes("", [NESTED])
    stream = parser.stream()
    cut = text.index('"filters"')
    first = stream.feed(text[:cut])
    assert [c.name for c in first.tool_calls] == ["search"]
    sent = "".join(c.arguments for c in first.tool_calls)
    assert sent and json.dumps(NESTED[1], ensure_ascii=False).startswith(sent)
    rest = collect([first, stream.feed(text[cut:]), stream.finish()])
    assert json.loads(rest.tool_calls[0].arguments) == NESTED[1]


def test_cut_off_call_keeps_what_was_streamed():
    """max_tokens in the middle of the arguments: the call stays (its name went out), with the
    arguments so far -- the same streamed or not."""
    text = hermes("", [WEATHER])
    cut = text[:text.index("celsius")]
    parser = get_tool_parser("hermes")
    final = parser.extract(cut)
    assert final.content is None and [c.name for c in final.tool_calls] == ["get_weather"]
    assert final.tool_calls[0].arguments.startswith('{"city": "Paris"')
    for sizes in chunkings(cut, 20, seed=1):
        assert collect(stream_in(parser.stream(), cut, sizes)) == final


def test_end_tag_ends_the_call_even_inside_a_broken_string():
    """A backslash before an argument's closing quote (a Windows path written with single
    backslashes) leaves the JSON string open; the end tag still ends the call, so the next call
    and the text after it are not swallowed (vLLM splits at the first end tag too)."""
    text = ('<tool_call>{"name": "f", "arguments": {"p": "C:\\tmp\\"}}</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>\nDone.')
    parser = get_tool_parser("hermes")
    final = parser.extract(text)
    assert final.content == "Done." and [c.name for c in final.tool_calls] == ["f", "g"]
    assert final.tool_calls[0].arguments == '{"p": "C:\\tmp\\"}}'  # what the model wrote
    assert final.tool_calls[1].arguments == "{}"
    for sizes in chunkings(text, 30, seed=4):
        check_stream(stream_in(parser.stream(), text, sizes), final)


@pytest.mark.parametrize("name, wrap", [
    ("hermes", lambda args: f'<tool_call>{{"name": "write", "arguments": {args}}}</tool_call>'),
    ("deepseek_v31", lambda args: f"<｜tool▁call▁begin｜>write<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"),
    ("llama3_json", lambda args: f'{{"name": "write", "parameters": {args}}}'),
    ("mistral", lambda args: f"[TOOL_CALLS]write[ARGS]{args}"),
    ("mistral", lambda args: f'[TOOL_CALLS] [{{"name": "write", "arguments": {args}}}]'),
])
def test_long_arguments_stream_without_rescanning(monkeypatch, name, wrap):
    """A 40 KB argument streamed 4 characters at a time is read once, not rescanned on every
    piece (which cost quadratic time inside the server's event loop): the number of full
    scans stays the same whatever the argument's length."""
    def full_scans(size: int) -> int:
        count, final = scans_streaming(monkeypatch, name,
                                        wrap(json.dumps({"content": "x" * size, "path": "a.txt"})))
        assert json.loads(final.tool_calls[0].arguments)["content"] == "x" * size
        return count

    assert full_scans(40_000) == full_scans(400)


@pytest.mark.parametrize("call", [
    '[TOOL_CALLS]write[ARGS]{"path": "a.txt"}',
    '[TOOL_CALLS] [{"name": "write", "arguments": {"path": "a.txt"}}]',
])
def test_text_after_a_call_without_end_tag_is_not_rescanning_it(monkeypatch, call):
    """Mistral's calls have no end tag: the text after one (up to the end of the output) must
    not make the call be read again on every piece."""
    def full_scans(words: int) -> int:
        count, final = scans_streaming(monkeypatch, "mistral", call + " and then" * words)
        assert [c.name for c in final.tool_calls] == ["write"]
        return count

    assert full_scans(2_000) == full_scans(20)


@pytest.mark.parametrize("name, text", [
    ("qwen3", "<think>\nThe user wants weather.\n</think>\n\n" + hermes("Checking.", [WEATHER])),
    # Hunyuan-A13B's calls sit in its <answer>.
    ("hunyuan_a13b", "<think>\nThe user wants weather.\n</think>\n<answer>\nChecking.\n"
     + tagged_json("<tool_calls>", "</tool_calls>", [WEATHER]) + "\n</answer>"),
    ("glm45", "<think>\nThe user wants weather.\n</think>\nChecking.\n<tool_call>get_weather\n"
     "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n"
     "<arg_value>celsius</arg_value>\n</tool_call>"),
])
def test_reasoning_then_tool_calls_streamed(name, text):
    """A model thinks, then calls a tool: reasoning, content and calls come apart the same way
    streamed in any chunking as in one piece."""
    def run(sizes: list[int]):
        parser = ChoiceOutputParser(get_reasoning_parser(name).stream(),
                                    get_tool_parser(name).stream())
        deltas = stream_in(parser, text, sizes)  # (it feeds and finishes as a stream does)
        message = parser.message(deltas)
        return (message.reasoning_content, message.content,
                [(c.function.name, c.function.arguments) for c in message.tool_calls],
                parser.finish_reason("stop"))

    whole = run([])
    assert whole[0] == "\nThe user wants weather.\n" and whole[1] == "Checking."
    assert [(n, json.loads(a)) for n, a in whole[2]] == [WEATHER] and whole[3] == "tool_calls"
    for sizes in chunkings(text, 30, seed=3):
        assert run(sizes) == whole


@pytest.mark.parametrize("name, wrap, is_call", [
    # A Llama 3 answer that is JSON but no call (no "name"): content, read once.
    ("llama3_json", lambda value: f'{{"items": {value}}}', False),
    # A call with another long key after its arguments, and a body with no name before one.
    ("hermes", lambda value: f'<tool_call>{{"name": "f", "arguments": {{}}, "note": {value}}}'
                             "</tool_call>", True),
    ("hermes", lambda value: f'<tool_call>{{"note": {value}, "name": "f", "arguments": {{}}}}'
                             "</tool_call>", True),
])
def test_long_json_outside_the_arguments_streams_without_rescanning(monkeypatch, name, wrap,
                                                                    is_call):
    """Any long value, not only the arguments, is read once: a 40 KB one streamed 4 characters
    at a time once cost 14 s of the server's event loop (a rescan of the object per piece)."""
    def full_scans(size: int) -> int:
        text = wrap(json.dumps([{"id": i, "label": "item"} for i in range(size // 30)]))
        count, final = scans_streaming(monkeypatch, name, text)
        assert final == get_tool_parser(name).extract(text)
        if is_call:
            assert [(c.name, c.arguments) for c in final.tool_calls] == [("f", "{}")]
        else:
            assert final.content == text and not final.tool_calls
        return count

    # A few scans whatever the length (a couple more or fewer as the pieces fall on the keys);
    # a rescan per piece was one per 4 characters: 10,000 here.
    assert full_scans(40_000) <= full_scans(400) + 8


@pytest.mark.parametrize("body", [
    '\n```json\n{"city": "Paris"}\n```',  # the template's fence
    '\n{"city": "Paris"}',  # no fence
    '\n```json {"city": "Paris"}```',  # fence and JSON on one line
    '\n```\n{"city": "Paris"}\n```',  # a fence without a language
])
def test_deepseek_v3_arguments_with_or_without_their_fence(body):
    """DeepSeek V3 models do not always fence the arguments as the template asks: the JSON is
    the arguments either way (it once became "{}", the call made without them)."""
    text = (f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather{body}"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    parser = get_tool_parser("deepseek_v3")
    final = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in final.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    for sizes in chunkings(text, 20, seed=len(body)):
        check_stream(stream_in(parser.stream(), text, sizes), final)


def test_registry_names_and_unknown():
    assert {"hermes", "qwen3", "llama3_json", "deepseek_v3"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*hermes.*llama3_json"):
        get_tool_parser("nope")


def test_call_ids_are_the_formats():
    """OpenAI's `call_...` by default; 9 letters or digits for Mistral, whose chat template
    refuses any other id when the client sends the conversation back."""
    import re

    assert re.fullmatch("call_[0-9a-f]{24}", get_tool_parser("hermes").new_call_id("f", 0))
    ids = {get_tool_parser("mistral").new_call_id("f", 0) for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in ids)


def test_serve_help_names_every_parser():
    """`ksana-llm serve --help` lists the built-in parsers, so a new one cannot go unlisted."""
    import argparse

    from ksana_llm.cli_args import add_serve_args
    from ksana_llm.server.reasoning_parsers import REASONING_PARSERS

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    helps = {action.dest: action.help or "" for action in parser._actions}
    for name in TOOL_PARSERS:
        assert name in helps["tool_call_parser"], name
    for name in REASONING_PARSERS:
        assert name in helps["reasoning_parser"], name


def test_kimi_k2_calls_keep_the_ids_their_markup_gives():
    """Kimi's template writes each call's id (`functions.NAME:INDEX`) back into the
    conversation: the client gets that id, streamed or not."""
    from ksana_llm.server.chat_output import ChoiceOutputParser

    text = kimi_k2("", [WEATHER, EMPTY])
    for sizes in chunkings(text, 10, seed=3):
        parser = ChoiceOutputParser(None, get_tool_parser("kimi_k2").stream())
        deltas = stream_in(parser, text, sizes)  # (it feeds and finishes as a stream does)
        message = parser.message(deltas)
        assert [(c.id, c.function.name) for c in message.tool_calls] == [
            ("functions.get_weather:0", "get_weather"), ("functions.list_files:1", "list_files")]
        streamed = [c.id for d in deltas for c in parser.delta_message(d).tool_calls or [] if c.id]
        assert streamed == ["functions.get_weather:0", "functions.list_files:1"]
