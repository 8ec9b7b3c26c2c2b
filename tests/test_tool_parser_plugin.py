"""`--tool-parser-plugin FILE`: tool-call parsers of one's own, loaded at start-up beside the
built-in ones. A real server picks the plugin's parser by name and answers the `openai` client
with its calls, streamed and not; every broken plugin is refused before the model loads, naming
the flag."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from ksana_llm.server.tool_parsers import TOOL_PARSERS
from ksana_llm.server.tool_parsers.plugin import load_tool_parser_plugin
from tests.server_process import ServerProcess

# Reads every answer as one call of `record`, the answer's text its argument: whatever the
# model writes, the call shows that the plugin's parser is the one reading it.
# Its call ids are its own, as a model whose template checks them (Mistral's) needs.
PLUGIN = '''
import json
import re
import uuid

from ksana_llm.server.tool_parsers import ParsedOutput, ToolCall, WholeTextToolParser


class EveryAnswerIsACall(WholeTextToolParser):
    name = "record_all"

    def parse(self, text):
        return ParsedOutput(None, [ToolCall("record", json.dumps({"text": text}))])

    @staticmethod
    def new_call_id(name, index):
        return "rec" + uuid.uuid4().hex[:6]
'''
PLUGIN_CALL_ID = re.compile("rec[0-9a-f]{6}")
TOOLS = [{"type": "function", "function": {
    "name": "record", "description": "Record a sentence.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "my_parsers.py"
    path.write_text(PLUGIN)
    return path


def test_plugin_parsers_load_by_name_and_stream_as_they_extract(plugin_file):
    parsers = load_tool_parser_plugin(str(plugin_file), TOOL_PARSERS)
    assert list(parsers) == ["record_all"]
    parser = parsers["record_all"]()
    whole = parser.extract("Paris is the capital.")
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == \
        [("record", {"text": "Paris is the capital."})]
    stream = parser.stream()
    deltas = [stream.feed(piece) for piece in ("Paris ", "is the", " capital.")]
    assert not any(deltas)  # a whole-text parser sends everything when the output ends
    end = stream.finish()
    assert (end.tool_calls[0].name, end.tool_calls[0].arguments) == \
        ("record", whole.tool_calls[0].arguments)


@pytest.mark.parametrize("source, needle", [
    (None, "no such file"),
    ("raise RuntimeError('broken on purpose')", "importing it failed (RuntimeError: broken on purpose)"),
    ("x = 1\n", "defines no ToolParser subclass"),
    ("from ksana_llm.server.tool_parsers import WholeTextToolParser\n"
     "class P(WholeTextToolParser):\n    name = 'hermes'\n    def parse(self, text): ...\n",
     "a built-in parser's name"),
    ("from ksana_llm.server.tool_parsers import WholeTextToolParser\n"
     "class P(WholeTextToolParser):\n    def parse(self, text): ...\n",
     "defines no ToolParser subclass with a `name`"),
    ("from ksana_llm.server.tool_parsers import WholeTextToolParser\n"
     "class P(WholeTextToolParser):\n    name = 'p'\n    def __init__(self):\n"
     "        raise OSError('no grammar file')\n    def parse(self, text): ...\n",
     "P() failed (OSError: no grammar file)"),
])
def test_broken_plugins_are_named(tmp_path, source, needle):
    path = tmp_path / "plugin.py"
    if source is not None:
        path.write_text(textwrap.dedent(source))
    with pytest.raises(ValueError, match=f"--tool-parser-plugin {path}") as info:
        load_tool_parser_plugin(str(path), TOOL_PARSERS)
    assert needle in str(info.value)


def test_plugins_load_as_modules_do(tmp_path):
    """A plugin runs as an imported module would (dataclasses with postponed annotations need
    that); a helper base class without a `name` of its own is not a parser."""
    path = tmp_path / "plugin.py"
    path.write_text(textwrap.dedent('''
        from __future__ import annotations

        from dataclasses import dataclass

        from ksana_llm.server.tool_parsers import ParsedOutput, WholeTextToolParser


        @dataclass
        class Settings:
            marker: str = "CALL:"


        class Base(WholeTextToolParser):
            settings = Settings()

            def parse(self, text: str) -> ParsedOutput:
                return ParsedOutput(text, [])


        class Mine(Base):
            name = "mine"
    '''))
    assert list(load_tool_parser_plugin(str(path), TOOL_PARSERS)) == ["mine"]


@pytest.mark.parametrize("body", ["raise KeyError('bug')", "return 'not a ParsedOutput'",
                                  "return ParsedOutput(None, [ToolCall('f', {'a': 1})])"])
def test_a_failing_parse_leaves_the_text_as_content(tmp_path, body):
    """A plugin's bug at request time (an exception, a wrong type) fails no request: the
    output is sent as content, as built-in parsers treat malformed markup."""
    path = tmp_path / "plugin.py"
    path.write_text("from ksana_llm.server.tool_parsers import ParsedOutput, ToolCall, "
                    "WholeTextToolParser\n"
                    f"class P(WholeTextToolParser):\n    name = 'p'\n"
                    f"    def parse(self, text):\n        {body}\n")
    parser = load_tool_parser_plugin(str(path), TOOL_PARSERS)["p"]()
    assert parser.extract("Paris.").content == "Paris." and parser.extract("Paris.").tool_calls == []
    stream = parser.stream()
    stream.feed("Par")
    stream.feed("is.")
    end = stream.finish()
    assert (end.content, end.tool_calls) == ("Paris.", [])


def test_a_broken_plugin_stops_serve_before_the_model_loads(tmp_path):
    path = tmp_path / "plugin.py"
    path.write_text("raise RuntimeError('broken on purpose')\n")
    proc = subprocess.run([sys.executable, "-m", "ksana_llm.cli", "serve", "--model",
                           "/nonexistent/model", "--tool-parser-plugin", str(path),
                           "--tool-call-parser", "record_all"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--tool-parser-plugin" in proc.stderr, proc.stderr
    assert "/nonexistent/model" not in proc.stderr


def test_server_answers_with_the_plugin_parser(plugin_file, default_model_dir):
    import openai

    server = ServerProcess(["--num-device-blocks", "64", "--max-model-len", "512",
                            "--tool-parser-plugin", str(plugin_file), "--tool-call-parser",
                            "record_all", "--enable-auto-tool-choice"])
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        kwargs = dict(model=model, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=8)
        answer = client.chat.completions.create(**kwargs)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "record"
        text = json.loads(call.function.arguments)["text"]
        assert text.strip() and answer.usage.completion_tokens == 8
        streamed = list(client.chat.completions.create(**kwargs, stream=True))
        calls = [c for chunk in streamed for d in chunk.choices
                 for c in (d.delta.tool_calls or [])]
        assert calls[0].function.name == "record"
        assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
        # The server's parser gives the ids, streamed or not, and for a call tool_choice forced.
        assert PLUGIN_CALL_ID.fullmatch(call.id) and PLUGIN_CALL_ID.fullmatch(calls[0].id)
        named = client.chat.completions.create(**kwargs, tool_choice={
            "type": "function", "function": {"name": "record"}})
        (forced,) = named.choices[0].message.tool_calls
        assert forced.function.name == "record" and PLUGIN_CALL_ID.fullmatch(forced.id)
    finally:
        server.stop()
