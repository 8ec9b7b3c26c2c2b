"""Tool-call parsers for ERNIE-4.5 (`ernie45`), Olmo 3 (`olmo3`), xLAM (`xlam`) and Step-3
(`step3`): model outputs written here in each format from known calls, read back whole and
streamed one character at a time and in random chunkings (which must add up to the whole
result), as in test_tool_parsers.py."""

from __future__ import annotations

import json

import pytest

from ksana_llm.server.tool_parsers import collect, get_tool_parser
from tests.test_tool_parsers_decoded import bare, check_typed_case
from tests.tool_parser_harness import (
    CALLS,
    EMPTY,
    NESTED,
    WEATHER,
    check_case,
    check_stream,
    chunkings,
    function_tool,
    stream_in,
)


def ernie45(content: str, calls: list) -> str:
    """ERNIE-4.5's template: hermes's blocks, each object on a line of its own."""
    blocks = "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n"
                     f"</tool_call>\n" for n, a in calls)
    return content + ("\n\n" if content and calls else "") + blocks


def olmo3(content: str, calls: list) -> str:
    """A `<function_calls>` block, one call per line, values as Python writes them (repr)."""
    lines = "".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")\n" for n, a in calls)
    return content + ("\n" if content else "") + f"<function_calls>\n{lines}</function_calls>"


def xlam_array(calls: list) -> str:
    return json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


STEP3_CALLS_BEGIN, STEP3_CALLS_END = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"


def step3(content: str, calls: list) -> str:
    """Step-3's block: per call `function<｜tool_sep｜>` and a steptml invoke, values as bare text."""
    parts = "".join(
        f'<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="{n}">\n'
        + "".join(f'<steptml:parameter name="{k}">{bare(v)}</steptml:parameter>\n' for k, v in a.items())
        + "</steptml:invoke><｜tool_call_end｜>\n" for n, a in calls)
    return f"{content}\n{STEP3_CALLS_BEGIN}\n{parts}{STEP3_CALLS_END}"


TOOLS = [
    function_tool("get_weather", {"city": {"type": "string"}, "unit": {"type": "string"}}),
    function_tool("search", {"query": {"type": "string"}, "filters": {"type": "object"},
                         "note": {"type": "string"}}),
    function_tool("list_files", {}),
    function_tool("typed", {"n": {"type": "integer"}, "x": {"type": "number"},
                        "flag": {"type": "boolean"}, "items": {"type": "array"},
                        "label": {"type": "string"}}),
]

# An argument with escapes and nesting in every format: quotes, a backslash, a newline, a tab,
# brackets, non-ASCII text, and a nested object holding an array.
ESCAPES = ("write", {"path": "C:\\tmp\\a \"b\".txt", "text": "line 1\nline\t2 ) ] }",
                     "meta": {"tags": ["x", {"y": [1, None, False]}], "size": -2.5e3}, "word": "日本"})


# (parser, model text, expected content, expected calls)
CASES = [
    # --- ernie45: hermes's blocks; text before them is content.
    ("ernie45", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("ernie45", ernie45("", [WEATHER]), None, [WEATHER]),
    ("ernie45", ernie45("", [WEATHER, EMPTY]), None, [WEATHER, EMPTY]),
    ("ernie45", ernie45("Let me look that up.", CALLS), "Let me look that up.", CALLS),
    ("ernie45", ernie45("", [ESCAPES]), None, [ESCAPES]),
    # The answer's <response> tags are no content (the reasoning parser usually took them off).
    ("ernie45", "<response>Paris.</response>", "Paris.", []),
    # A block that holds no call is content, tags included.
    ("ernie45", "<tool_call>\nnot json\n</tool_call> ok", "<tool_call>\nnot json\n</tool_call> ok", []),

    # --- olmo3: pythonic calls, one per line, in <function_calls>.
    ("olmo3", "Olmo says: f(x) = 2x, see <b>bold</b>.", "Olmo says: f(x) = 2x, see <b>bold</b>.", []),
    ("olmo3", olmo3("", [WEATHER]), None, [WEATHER]),
    ("olmo3", olmo3("", [WEATHER, EMPTY]), None, [WEATHER, EMPTY]),
    ("olmo3", olmo3("Let me look that up.", CALLS), "Let me look that up.", CALLS),
    ("olmo3", olmo3("", [ESCAPES]), None, [ESCAPES]),
    ("olmo3", olmo3("", [WEATHER]) + "\nAnything else?", "Anything else?", [WEATHER]),
    # JSON's null / true / false as values, double quotes, a triple-quoted string.
    ("olmo3", '<function_calls>\nf(a=null, b=true, c=false, d=[None, True], e="x\\"y", '
     "g='''it's ) here''')\n</function_calls>", None,
     [("f", {"a": None, "b": True, "c": False, "d": [None, True], "e": 'x"y', "g": "it's ) here"})]),
    # Two calls on one line, a comma between them.
    ("olmo3", "<function_calls>f(a=1), g(b='2')</function_calls>", None, [("f", {"a": 1}), ("g", {"b": "2"})]),
    # A block whose call is not one (a positional argument; prose) is content, tags included.
    ("olmo3", "<function_calls>\nget_weather('Paris')\n</function_calls> ok",
     "<function_calls>\nget_weather('Paris')\n</function_calls> ok", []),
    ("olmo3", "<function_calls>I can't call tools.</function_calls>",
     "<function_calls>I can't call tools.</function_calls>", []),
    # A pythonic list outside the block is text to it.
    ("olmo3", "[get_weather(city='Paris')]", "[get_weather(city='Paris')]", []),

    # --- xlam: a JSON array of calls, alone or in a fence / tags / after [TOOL_CALLS].
    ("xlam", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("xlam", xlam_array([WEATHER]), None, [WEATHER]),
    ("xlam", xlam_array([WEATHER, EMPTY]), None, [WEATHER, EMPTY]),
    ("xlam", "  " + xlam_array(CALLS), None, CALLS),
    ("xlam", xlam_array([ESCAPES]), None, [ESCAPES]),
    ("xlam", xlam_array([WEATHER]) + "\nDone.", "Done.", [WEATHER]),
    ("xlam", "Let me check.\n```json\n" + xlam_array(CALLS) + "\n```", "Let me check.", CALLS),
    ("xlam", "```\n" + xlam_array([WEATHER]) + "\n```", None, [WEATHER]),
    ("xlam", "On it. <tool_call>" + xlam_array([WEATHER, EMPTY]) + "</tool_call>", "On it.",
     [WEATHER, EMPTY]),
    ("xlam", "[TOOL_CALLS]" + xlam_array([NESTED]), None, [NESTED]),
    ("xlam", "Checking. [TOOL_CALLS] " + xlam_array([WEATHER]), "Checking.", [WEATHER]),
    # Arrays and code blocks that hold no calls are content, fences included.
    ("xlam", "[1, 2] are the numbers.", "[1, 2] are the numbers.", []),
    ("xlam", "Run:\n```python\nprint([1])\n```\nok", "Run:\n```python\nprint([1])\n```\nok", []),
    ("xlam", '```json\n{"answer": 42}\n```', '```json\n{"answer": 42}\n```', []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_extract_and_stream(name, text, content, calls):
    check_case(name, text, content, calls)


@pytest.mark.parametrize("text, tools, content, calls", [
    ("The answer is 42.", TOOLS, "The answer is 42.", []),
    (step3("", [WEATHER]), TOOLS, None, [WEATHER]),
    (step3("", [WEATHER, EMPTY]), TOOLS, None, [WEATHER, EMPTY]),
    (step3("Let me look that up.", CALLS), TOOLS, "Let me look that up.", CALLS),
    (step3("", [("typed", {"n": 3, "x": 2.5, "flag": True, "items": ["a", {"b": None}], "label": "7"})]),
     TOOLS, None, [("typed", {"n": 3, "x": 2.5, "flag": True, "items": ["a", {"b": None}], "label": "7"})]),
    # Without the request's tools every value is text.
    (step3("", [("typed", {"n": 3, "flag": False})]), None, None, [("typed", {"n": "3", "flag": "false"})]),
    # Text values keep their escapes, brackets and newlines inside; the layout around them goes.
    ('<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="write">'
     '<steptml:parameter name="path"> C:\\tmp\\a "b".txt\n</steptml:parameter><steptml:parameter '
     'name="text">if a < b:\n\treturn {"x": [1]}</steptml:parameter></steptml:invoke>'
     "<｜tool_call_end｜><｜tool_calls_end｜>", TOOLS, None,
     [("write", {"path": 'C:\\tmp\\a "b".txt', "text": 'if a < b:\n\treturn {"x": [1]}'})]),
    # A call region that holds no invoke is content, tags included.
    ("<｜tool_call_begin｜>hello<｜tool_call_end｜> ok", TOOLS,
     "<｜tool_call_begin｜>hello<｜tool_call_end｜> ok", []),
])
def test_step3(text, tools, content, calls):
    check_typed_case("step3", text, tools, content, calls)


@pytest.mark.parametrize("name, text, content, calls", [
    # Cut off before the name is complete: never a call, the text is content as written.
    ("ernie45", '<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', []),
    ("olmo3", "<function_calls>\nget_weather(city=", "<function_calls>\nget_weather(city=", []),
    ("xlam", '[{"name": "get_wea', '[{"name": "get_wea', []),
    ("xlam", 'Sure. ```json\n[{"name": "get_wea', 'Sure. ```json\n[{"name": "get_wea', []),
    # Cut off inside a later call: the calls before it stand. (The rest of a tagged region
    # that gave no call goes back as content with the region's start tag.)
    ("olmo3", "<function_calls>\nget_weather(city='Paris')\nget_time(tz=",
     "<function_calls>get_time(tz=", [("get_weather", {"city": "Paris"})]),
    # (The JSON call list's object whose name never came is content after all.)
    ("xlam", '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_ti',
     '{"name": "get_ti', [("get_weather", {"city": "Paris"})]),
    # Step-3, cut off inside a named call: its parameters so far make a whole object.
    ("step3", '<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke '
     'name="get_weather">\n<steptml:parameter name="city">Par', None, [("get_weather", {"city": "Par"})]),
    ("step3", '<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke '
     'name="list_files">', None, [EMPTY]),
])
def test_cut_off(name, text, content, calls):
    check_case(name, text, content, calls)


@pytest.mark.parametrize("name, text", [
    ("ernie45", ernie45("", [WEATHER])),
    ("xlam", xlam_array([WEATHER])),
    ("xlam", "Sure.\n```json\n" + xlam_array([WEATHER]) + "\n```"),
])
def test_json_arguments_cut_off_keep_what_was_streamed(name, text):
    """max_tokens inside a JSON call's arguments: the call stays, with the arguments so far,
    the same streamed or not (as hermes's do)."""
    cut = text[:text.index("celsius")]
    parser = get_tool_parser(name)
    final = parser.extract(cut)
    assert [c.name for c in final.tool_calls] == ["get_weather"]
    assert final.tool_calls[0].arguments.startswith('{"city": "Paris"')
    assert final.content in (None, "Sure.")
    for sizes in chunkings(cut, 20, seed=1):
        check_stream(stream_in(parser.stream(), cut, sizes), final)


def test_olmo3_calls_go_out_as_each_closes_and_are_read_once(monkeypatch):
    """Each call goes out when its closing parenthesis arrives, before the block ends; a 40 KB
    argument streamed 4 characters at a time is parsed once."""
    import ksana_llm.server.tool_parsers.olmo3 as olmo3_module

    text = olmo3("", [WEATHER, ("write", {"content": "x" * 40_000, "path": "a.txt"})])
    stream = get_tool_parser("olmo3").stream()
    first = stream.feed(text[:text.index("write")])
    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [WEATHER]
    parsed: list[str] = []
    real = olmo3_module.python_call
    monkeypatch.setattr(olmo3_module, "python_call",
                        lambda source, json_names=False: parsed.append(source) or real(source, json_names))
    rest = text[text.index("write"):]
    deltas = [stream.feed(rest[i:i + 4]) for i in range(0, len(rest), 4)] + [stream.finish()]
    assert len(parsed) == 1
    (call,) = collect(deltas).tool_calls
    assert call.name == "write" and json.loads(call.arguments)["content"] == "x" * 40_000


def test_step3_decodes_with_special_tokens():
    """Step-3's markers are special tokens: without them in the text no call could be read."""
    assert get_tool_parser("step3").reads_special_tokens
    assert not get_tool_parser("olmo3").reads_special_tokens
