"""Tool-call formats whose argument values are decoded rather than copied: pythonic calls'
Python literals, Qwen3-Coder's and GLM-4.5's tagged parameters (typed by the request's tool schema) and
DeepSeek-V3.2's DSML. Whole and streamed in many chunkings, as in test_tool_parsers.py."""

from __future__ import annotations

import json

import pytest

from ksana_llm.server.tool_parsers import collect, get_tool_parser
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


def pythonic(calls: list, tags: bool = False) -> str:
    """`[name(key=literal, ...), ...]`, the literals as Python writes them (repr)."""
    text = "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                           for n, a in calls) + "]"
    return f"<|python_start|>{text}<|python_end|>" if tags else text


def deepseek_v32(content: str, calls: list) -> str:
    """DSML: strings as plain text (`string="true"`), other values as JSON."""
    def parameter(key, value) -> str:
        is_string = isinstance(value, str)
        text = value if is_string else json.dumps(value, ensure_ascii=False)
        return (f'<｜DSML｜parameter name="{key}" string="{str(is_string).lower()}">{text}'
                f"</｜DSML｜parameter>\n")
    invokes = "".join(f'<｜DSML｜invoke name="{n}">\n' + "".join(parameter(k, v) for k, v in a.items())
                      + "</｜DSML｜invoke>\n" for n, a in calls)
    return f"{content}\n\n<｜DSML｜function_calls>\n{invokes}</｜DSML｜function_calls>"


# (parser, model text, expected content, expected calls)
CASES = [
    ("pythonic", pythonic(CALLS), None, CALLS),
    ("llama4_pythonic", pythonic([WEATHER, EMPTY], tags=True), None, [WEATHER, EMPTY]),
    ("pythonic", pythonic([WEATHER]) + "\nDone.", "Done.", [WEATHER]),
    ("pythonic", "[1, 2, 3] are the numbers.", "[1, 2, 3] are the numbers.", []),
    ("pythonic", "The answer is [x].", "The answer is [x].", []),
    ("pythonic", "[]", "[]", []),
    ("pythonic", "[See (note)] below.", "[See (note)] below.", []),
    # Not calls: positional arguments; a value without a JSON form (a set).
    ("pythonic", "[get_weather('Paris')]", "[get_weather('Paris')]", []),
    ("pythonic", "[f(a={1, 2})]", "[f(a={1, 2})]", []),
    # A call that is not one after a call: the calls so far stay, the rest goes.
    ("pythonic", "[get_weather(city='Paris'), get_weather(city=open('x'))] ok", None,
     [("get_weather", {"city": "Paris"})]),
    ("deepseek_v32", deepseek_v32("Checking both.", CALLS), "Checking both.", CALLS),
    ("deepseek_v32", deepseek_v32("", [WEATHER]), None, [WEATHER]),
    # string="false" text that is not JSON stays text; an invoke without a name is content.
    ("deepseek_v32", '<｜DSML｜function_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="n" '
     'string="false">twelve</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>', None,
     [("f", {"n": "twelve"})]),
    ("deepseek_v32", "<｜DSML｜invoke name=>x</｜DSML｜invoke> ok", "<｜DSML｜invoke name=>x</｜DSML｜invoke> ok", []),
    # A trailing comma (Python allows it); Llama 4's end tag after a newline; a name that is
    # not ASCII is no function's; a bracketed answer with an apostrophe is content.
    ("pythonic", "[get_weather(city='Oslo'), ] and more", "and more", [("get_weather", {"city": "Oslo"})]),
    ("llama4_pythonic", "<|python_start|>[f(a=1)]\n<|python_end|>", None, [("f", {"a": 1})]),
    ("pythonic", "[é(a=1)]", "[é(a=1)]", []),
    ("pythonic", "[Don't worry] about it.", "[Don't worry] about it.", []),
    # Escaped surrogate pairs in a Python literal are one character in the JSON.
    ("pythonic", "[f(text='\\ud83d\\ude00')]", None, [("f", {"text": "\U0001F600"})]),
    # Brackets, quotes and escapes inside strings (a triple-quoted one too) do not end a call.
    ("pythonic", '[write(text="""a ) ] \\""" b""", path=\'x\\\'y]\')]', None,
     [("write", {"text": 'a ) ] """ b', "path": "x'y]"})]),
]


@pytest.mark.parametrize("name,text,content,calls", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_extract_and_stream(name, text, content, calls):
    check_case(name, text, content, calls)


def test_pythonic_calls_go_out_as_each_closes_and_are_parsed_once(monkeypatch):
    """Each call is sent when its closing parenthesis arrives, before the list ends; a 40 KB
    argument streamed 4 characters at a time is parsed once, with its call."""
    import ksana_llm.server.tool_parsers.pythonic as pythonic_module

    text = pythonic([WEATHER, ("write", {"content": "x" * 40_000, "path": "a.txt"})])
    stream = get_tool_parser("pythonic").stream()
    first = stream.feed(text[:text.index("write")])
    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [WEATHER]
    parsed: list[str] = []
    real = pythonic_module.python_call
    monkeypatch.setattr(pythonic_module, "python_call", lambda source: parsed.append(source) or real(source))
    rest = text[text.index("write"):]
    deltas = [stream.feed(rest[i:i + 4]) for i in range(0, len(rest), 4)] + [stream.finish()]
    assert len(parsed) == 1
    (call,) = collect(deltas).tool_calls
    assert call.name == "write" and json.loads(call.arguments)["content"] == "x" * 40_000


@pytest.mark.parametrize("cut_at, content, names", [
    ("city", "[get_weather(", []),  # inside the first call: the output was never calls
    ("search", None, ["get_weather"]),  # inside the second: the first stays
])
def test_pythonic_cut_off(cut_at, content, names):
    text = pythonic([WEATHER, NESTED])
    cut = text[:text.index(cut_at)]
    parser = get_tool_parser("pythonic")
    final = parser.extract(cut)
    assert final.content == content and [c.name for c in final.tool_calls] == names
    for sizes in chunkings(cut, 20, seed=2):
        assert collect(stream_in(parser.stream(), cut, sizes)) == final


def bare(value) -> str:
    """A parameter's value as the XML-style templates write it: strings as they are, JSON else."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def qwen3_coder(content: str, calls: list, block: tuple[str, str] = ("<tool_call>", "</tool_call>"),
                frame: str = "\n") -> str:
    """Qwen3-Coder's template: each parameter's value as bare text between `frame`s (newlines);
    Seed-OSS's with its own `block` tags and no frame."""
    blocks = []
    for name, args in calls:
        params = "".join(f"<parameter={k}>{frame}{bare(v)}{frame}</parameter>\n" for k, v in args.items())
        blocks.append(f"{block[0]}\n<function={name}>\n{params}</function>\n{block[1]}")
    return content + ("\n" if content and blocks else "") + "\n".join(blocks)


def check_typed_case(name: str, text: str, tools, content, calls) -> None:
    """`text` read by parser `name` with the request's `tools`: the content and calls
    (arguments as JSON values) whole, and the same in 40 chunkings."""
    parser = get_tool_parser(name)
    final = collect([(s := parser.stream_for(tools)).feed(text), s.finish()])
    assert final.content == content
    for call in final.tool_calls:
        call.arguments.encode()  # a response body can carry it (no lone surrogates)
    assert [(c.name, json.loads(c.arguments)) for c in final.tool_calls] == calls
    for sizes in chunkings(text, 40, seed=len(text)):
        check_stream(stream_in(parser.stream_for(tools), text, sizes), final)


CODER_TOOLS = [
    function_tool("get_weather", {"city": {"type": "string"}, "unit": {"type": "string"}}),
    function_tool("search", {"query": {"type": "string"}, "filters": {"type": "object"},
                         "note": {"type": "string"}}),
    function_tool("list_files", {}),
    function_tool("typed", {"n": {"type": "integer"}, "x": {"type": "number"}, "whole": {"type": "number"},
                        "flag": {"type": "boolean"}, "items": {"type": "array"},
                        "maybe": {"type": ["integer", "null"]}, "either": {"anyOf": [
                            {"type": "boolean"}, {"type": "string"}]}}),
]
TYPED_TEXT = ("<tool_call>\n<function=typed>\n<parameter=n>\n42\n</parameter>\n<parameter=x>\n2.5\n"
              "</parameter>\n<parameter=whole>\n4\n</parameter>\n<parameter=flag>\nTrue\n</parameter>\n"
              "<parameter=items>\n['a', 1]\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n"
              "<parameter=either>\nfalse\n</parameter>\n<parameter=extra>\n7\n</parameter>\n"
              "</function>\n</tool_call>")


@pytest.mark.parametrize("text, tools, content, calls", [
    (qwen3_coder("Let me look that up.", CALLS), CODER_TOOLS, "Let me look that up.", CALLS),
    (qwen3_coder("", [WEATHER]) + "\nAnything else?", CODER_TOOLS, "Anything else?", [WEATHER]),
    # Types from the schema; `extra` (not in it) stays text.
    (TYPED_TEXT, CODER_TOOLS, None, [("typed", {"n": 42, "x": 2.5, "whole": 4, "flag": True,
                                                "items": ["a", 1], "maybe": None, "either": False,
                                                "extra": "7"})]),
    # Without the request's tools every value is text (null still null).
    (TYPED_TEXT, None, None, [("typed", {"n": "42", "x": "2.5", "whole": "4", "flag": "True",
                                         "items": "['a', 1]", "maybe": None, "either": "false",
                                         "extra": "7"})]),
    # Text that does not read as the declared type stays as written.
    ("<tool_call>\n<function=typed>\n<parameter=n>\nforty-two\n</parameter>\n<parameter=items>\n"
     "{1, 2}\n</parameter>\n</function>\n</tool_call>", CODER_TOOLS, None,
     [("typed", {"n": "forty-two", "items": "{1, 2}"})]),
    # A closing tag left out: the value ends where the next parameter (or the function's end) starts.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=unit>\nC\n</function>\n"
     "</tool_call>", CODER_TOOLS, None, [("get_weather", {"city": "Oslo", "unit": "C"})]),
    # Code in a value, angle brackets and all; only its framing newlines go.
    ("<tool_call>\n<function=write>\n<parameter=code>\n\nif a < b:\n    return '</p>'\n\n</parameter>\n"
     "</function>\n</tool_call>", CODER_TOOLS, None,
     [("write", {"code": "\nif a < b:\n    return '</p>'\n"})]),
    ("<tool_call>\n<function=list_files>\n</function>\n</tool_call>", CODER_TOOLS, None, [EMPTY]),
    # </function> left out: the end of the tool call ends the value and the function.
    ("<tool_call>\n<function=typed>\n<parameter=n>\n1\n</parameter>\n</tool_call>\nDone.", CODER_TOOLS,
     "Done.", [("typed", {"n": 1})]),
    ("<tool_call>\n<function=typed>\n<parameter=n>\n1\n</tool_call>", CODER_TOOLS, None, [("typed", {"n": 1})]),
    ("<tool_call>\n<function=list_files>\n</tool_call>", CODER_TOOLS, None, [EMPTY]),
    # A whole number past float precision; an array of escaped surrogate pairs.
    ("<tool_call>\n<function=typed>\n<parameter=whole>\n12345678901234567891\n</parameter>\n"
     "<parameter=items>\n['\\ud83d\\ude00']\n</parameter>\n</function>\n</tool_call>", CODER_TOOLS, None,
     [("typed", {"whole": 12345678901234567891, "items": ["\U0001F600"]})]),
    # Not a call: the region is content, tags included.
    ("<tool_call>\nnot a function\n</tool_call> ok", CODER_TOOLS,
     "<tool_call>\nnot a function\n</tool_call> ok", []),
])
def test_qwen3_coder(text, tools, content, calls):
    from ksana_llm.server.tools import plan_tools

    check_typed_case("qwen3_coder", text, tools, content, calls)
    if tools is not None:  # a request's plan hands its tools to the parser
        parser = get_tool_parser("qwen3_coder")
        plan = plan_tools(tools, "auto", parallel_tool_calls=None, auto_enabled=True, parser=parser)
        got = collect(stream_in(plan.stream(), text, [7] * len(text)))
        assert got.content == content
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls


def test_qwen3_coder_streams_each_parameter_once_complete(monkeypatch):
    """A call's name goes out with its tag, each parameter with its closing tag; a 40 KB value
    streamed 4 characters at a time is read as a value once."""
    import ksana_llm.server.tool_parsers.qwen3_coder as coder

    text = qwen3_coder("", [("write", {"path": "a.txt", "content": "x" * 40_000})])
    stream = get_tool_parser("qwen3_coder").stream_for(CODER_TOOLS)
    head = stream.feed(text[:text.index("<parameter=content>")])
    assert [(c.name, c.arguments) for c in head.tool_calls] == [("write", '{"path": "a.txt"')]
    typed: list[str] = []
    real = coder.typed_value
    monkeypatch.setattr(coder, "typed_value", lambda value, schema: typed.append(value) or real(value, schema))
    rest = text[text.index("<parameter=content>"):]
    deltas = [head] + [stream.feed(rest[i:i + 4]) for i in range(0, len(rest), 4)] + [stream.finish()]
    assert typed == ["x" * 40_000]
    (call,) = collect(deltas).tool_calls
    assert json.loads(call.arguments) == {"path": "a.txt", "content": "x" * 40_000}


def glm(content: str, calls: list, compact: bool = False) -> str:
    """GLM-4.5's template (GLM-4.7's with `compact`: no newlines between the tags): strings as
    they are, other values as JSON."""
    nl = "" if compact else "\n"
    blocks = []
    for name, args in calls:
        params = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{bare(v)}</arg_value>{nl}"
                         for k, v in args.items())
        blocks.append(f"{nl}<tool_call>{name}{nl}{params}</tool_call>")
    return content + "".join(blocks)


GLM_TOOLS = [*CODER_TOOLS, function_tool("note", {"text": {"type": "string"}})]


@pytest.mark.parametrize("name", ["glm45", "glm47"])
@pytest.mark.parametrize("text, tools, content, calls", [
    (glm("Let me look that up.", CALLS), GLM_TOOLS, "Let me look that up.", CALLS),
    (glm("", CALLS, compact=True), GLM_TOOLS, None, CALLS),
    (glm("", [WEATHER]) + "\nAnything else?", None, "Anything else?", [WEATHER]),
    # A string the schema declares stays text, JSON-looking or not; without the request's
    # tools (or for a parameter it does not declare) a value that reads as JSON or a Python
    # literal is that value, anything else text.
    (glm("", [("note", {"text": "42"}), ("typed", {"n": 7, "items": ["a", 1], "flag": True})]),
     GLM_TOOLS, None, [("note", {"text": "42"}), ("typed", {"n": 7, "items": ["a", 1], "flag": True})]),
    (glm("", [("note", {"text": "42"})]), None, None, [("note", {"text": 42})]),
    ("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>['x', None]</arg_value>\n<arg_key>b</arg_key>"
     "<arg_value> two words </arg_value>\n</tool_call>", None, None,
     [("f", {"a": ["x", None], "b": " two words "})]),
    # A call without arguments, on one line or two; the literal `\n` models write between tags.
    ("<tool_call>list_files</tool_call>", GLM_TOOLS, None, [EMPTY]),
    ("<tool_call>list_files\n</tool_call>Done.", GLM_TOOLS, "Done.", [EMPTY]),
    ("<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n"
     "</tool_call>", GLM_TOOLS, None, [("get_weather", {"city": "Paris"})]),
    # </arg_value> left out: the value ends where the next key or the call's end starts.
    ("<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Oslo\n<arg_key>unit</arg_key>"
     "<arg_value>C</tool_call>", GLM_TOOLS, None, [("get_weather", {"city": "Oslo\n", "unit": "C"})]),
    # Not a call: no function name in the region; it is content, tags included.
    ("<tool_call>\n{\"name\": \"f\"}\n</tool_call> ok", GLM_TOOLS,
     "<tool_call>\n{\"name\": \"f\"}\n</tool_call> ok", []),
    ("Wrap calls in <tool_call> ... </tool_call> tags.", GLM_TOOLS,
     "Wrap calls in <tool_call> ... </tool_call> tags.", []),
])
def test_glm(name, text, tools, content, calls):
    check_typed_case(name, text, tools, content, calls)


def test_glm_streams_the_name_then_each_parameter_once_complete(monkeypatch):
    import ksana_llm.server.tool_parsers.glm as glm_module

    text = glm("", [("write", {"path": "a.txt", "content": "x" * 40_000})])
    stream = get_tool_parser("glm45").stream_for(GLM_TOOLS)
    named = stream.feed(text[:text.index("<arg_key>")])
    assert [(c.name, c.arguments) for c in named.tool_calls] == [("write", "{")]
    head = stream.feed(text[text.index("<arg_key>"):text.index("<arg_key>content")])
    assert [c.arguments for c in head.tool_calls] == ['"path": "a.txt"']
    read: list[str] = []
    real = glm_module.read_literal
    monkeypatch.setattr(glm_module, "read_literal", lambda value: read.append(value) or real(value))
    rest = text[text.index("<arg_key>content"):]
    deltas = [named, head] + [stream.feed(rest[i:i + 4]) for i in range(0, len(rest), 4)] + [stream.finish()]
    assert read == ["x" * 40_000]
    (call,) = collect(deltas).tool_calls
    assert json.loads(call.arguments) == {"path": "a.txt", "content": "x" * 40_000}


def seed_oss(content: str, calls: list) -> str:
    return qwen3_coder(content, calls, ("<seed:tool_call>", "</seed:tool_call>"), frame="")


@pytest.mark.parametrize("text, tools, content, calls", [
    (seed_oss("Let me look that up.", CALLS), CODER_TOOLS, "Let me look that up.", CALLS),
    (seed_oss("", [("typed", {"n": 3, "flag": False, "items": [1]})]), CODER_TOOLS, None,
     [("typed", {"n": 3, "flag": False, "items": [1]})]),
    (seed_oss("", [("typed", {"n": 3})]), None, None, [("typed", {"n": "3"})]),
    # Qwen3-Coder's own tags are not Seed-OSS's calls.
    (qwen3_coder("", [WEATHER]), CODER_TOOLS, qwen3_coder("", [WEATHER]), []),
    # Several functions in one block: each a call.
    ("<seed:tool_call>\n<function=list_files>\n</function>\n<function=typed>\n<parameter=n>3"
     "</parameter>\n</function>\n</seed:tool_call>", CODER_TOOLS, None, [EMPTY, ("typed", {"n": 3})]),
])
def test_seed_oss(text, tools, content, calls):
    check_typed_case("seed_oss", text, tools, content, calls)


def minimax_m2(content: str, calls: list) -> str:
    """MiniMax-M2's template: an <invoke> per call in one block, values as bare text."""
    invokes = "".join(
        f'<invoke name="{n}">\n' + "".join(
            f'<parameter name="{k}">{bare(v)}</parameter>\n' for k, v in a.items()) + "</invoke>\n"
        for n, a in calls)
    return f"{content}\n<minimax:tool_call>\n{invokes}</minimax:tool_call>"


@pytest.mark.parametrize("text, tools, content, calls", [
    (minimax_m2("Let me look that up.", CALLS), CODER_TOOLS, "Let me look that up.", CALLS),
    (minimax_m2("", [("typed", {"n": 3, "flag": True, "items": ["a"]})]), CODER_TOOLS, None,
     [("typed", {"n": 3, "flag": True, "items": ["a"]})]),
    # Without the request's tools every value is text.
    (minimax_m2("", [("typed", {"n": 3})]), None, None, [("typed", {"n": "3"})]),
    # Outside a block an invoke is text, and so is a block's end tag.
    ('See </minimax:tool_call> and <invoke name="f"></invoke> ok', CODER_TOOLS,
     'See </minimax:tool_call> and <invoke name="f"></invoke> ok', []),
    ('<minimax:tool_call><invoke name="">x</invoke></minimax:tool_call> ok', CODER_TOOLS,
     '<minimax:tool_call><invoke name="">x</invoke></minimax:tool_call> ok', []),
    # An </invoke> left out: the block's end, or the next invoke, ends the function.
    ('<minimax:tool_call>\n<invoke name="typed">\n<parameter name="n">7</parameter>\n'
     '</minimax:tool_call>\nDone. <minimax:tool_call><invoke name="list_files"></invoke>'
     '</minimax:tool_call>', CODER_TOOLS, "Done.", [("typed", {"n": 7}), EMPTY]),
    ('<minimax:tool_call>\n<invoke name="typed">\n<parameter name="n">7</parameter>\n'
     '<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n</invoke>\n'
     '</minimax:tool_call>', CODER_TOOLS, None, [("typed", {"n": 7}), ("get_weather", {"city": "Oslo"})]),
])
def test_minimax_m2(text, tools, content, calls):
    check_typed_case("minimax_m2", text, tools, content, calls)


@pytest.mark.parametrize("name, region", [
    # JSON in GLM's tags: no name, the region is content; so is a long line after the tag.
    ("glm45", lambda n: "<tool_call>\n" + json.dumps({"name": "write", "arguments": {"c": "x" * n}})
     + "\n</tool_call>"),
    ("glm45", lambda n: "<tool_call>" + "word " * (n // 5) + "</tool_call>"),
    # A parameter whose header never closes; stray text between parameters.
    ("glm45", lambda n: "<tool_call>write\n<arg_key>" + "k" * n + "</tool_call>"),
    ("qwen3_coder", lambda n: "<tool_call>\n<function=write>\n" + "x" * n
     + "<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"),
])
def test_tagged_parameter_bodies_are_read_in_linear_time(monkeypatch, name, region):
    """Each search goes on from where the last stopped: streamed 4 characters at a time, the
    text the searches read grows with the output's length, not with its square."""
    import ksana_llm.server.tool_parsers.xml_calls as xml_calls

    real = xml_calls._first

    def read_per_character(size: int) -> float:
        read = 0

        def counting(text, tags, start):
            nonlocal read
            read += max(0, len(text) - start)
            return real(text, tags, start)

        text = region(size)
        monkeypatch.setattr(xml_calls, "_first", counting)
        final = collect(stream_in(get_tool_parser(name).stream(), text, [4] * (len(text) // 4 + 1)))
        monkeypatch.setattr(xml_calls, "_first", real)
        assert final == get_tool_parser(name).extract(text)
        return read / len(text)

    assert read_per_character(40_000) < 2 * read_per_character(4_000) + 20


@pytest.mark.parametrize("name, text, calls", [
    # A key the call's end cut short: the parameters before it stand, the call ends.
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key></tool_call>",
     [("f", {"a": 1})]),
    ("glm45", "<tool_call>f\n<arg_key>a\n<arg_value>1</arg_value>\n</tool_call>", [("f", {})]),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a\n</function>\n</tool_call>", [("f", {})]),
    # The next function's start ends one whose end tags were left out.
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n<function=g>\n</function>\n"
     "</tool_call>", [("f", {"a": "1"}), ("g", {})]),
    # Output that ends inside a named call (no end tag; a length limit): the arguments so far
    # make a whole object, the last value as far as it got.
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n",
     [("get_weather", {"city": "Paris"})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
     [("get_weather", {"city": "Par"})]),
    ("glm45", "<tool_call>get_weather\n", [("get_weather", {})]),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\n", [("f", {"a": "x"})]),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">x', [("f", {"a": "x"})]),
])
def test_broken_or_cut_off_calls_keep_whole_arguments(name, text, calls):
    parser = get_tool_parser(name)
    final = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in final.tool_calls] == calls
    for sizes in chunkings(text, 30, seed=3):
        check_stream(stream_in(parser.stream(), text, sizes), final)


def test_cut_off_before_the_name_ends_is_content():
    assert get_tool_parser("glm45").extract("<tool_call>get_wea").content == "<tool_call>get_wea"
