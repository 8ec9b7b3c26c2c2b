"""What the tool-call parser tests share: known calls, and a model output streamed through a
parser in many chunkings, each checked against the non-streamed result (names before
arguments, each call announced once, no half-written tag sent as content)."""

from __future__ import annotations

import json
import random

from ksana_llm.server.tool_parsers import (
    ParsedOutput,
    ToolCallStream,
    collect,
    get_tool_parser,
)

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
NESTED = ("search", {"query": "tags: {a} [b] \"quoted\" <tool_call> \\", "filters": {"n": [1, 2.5, None, True]},
                     "note": "naïve — ünïcode"})
EMPTY = ("list_files", {})
CALLS = [WEATHER, NESTED, EMPTY]


def stream_in(stream: ToolCallStream, text: str, sizes: list[int]) -> list:
    """`text` fed to `stream` in pieces of `sizes` (the rest in one), then finished: the deltas.
    (Any object that feeds and finishes so: reasoning splitters, ChoiceOutputParser.)"""
    deltas, i = [], 0
    for size in sizes:
        deltas.append(stream.feed(text[i:i + size]))
        i += size
    deltas.append(stream.feed(text[i:]))
    deltas.append(stream.finish())
    return deltas


def chunkings(text: str, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[1] * len(text), [len(text)]]
    for _ in range(count):
        sizes, total = [], 0
        while total < len(text):
            sizes.append(rng.randint(1, 12))
            total += sizes[-1]
        out.append(sizes)
    return out


def check_stream(deltas: list, final: ParsedOutput) -> None:
    """Names before arguments, each call announced once, no half tag in the content."""
    assert collect(deltas) == final
    announced: set[int] = set()
    for d in deltas:
        for call in d.tool_calls:
            if call.name is not None:
                assert call.index not in announced
                announced.add(call.index)
            else:
                assert call.index in announced and call.arguments
    if final.content is None or "<" not in final.content:
        assert not any("<" in d.content for d in deltas)


def check_case(name: str, text: str, content: str | None, calls: list) -> None:
    """Parser `name` reads `text` as `content` and `calls` ((name, arguments object) pairs),
    whole and in 62 chunkings."""
    parser = get_tool_parser(name)
    final = parser.extract(text)
    for call in final.tool_calls:
        call.arguments.encode()  # a response body can carry it (no lone surrogates)
    assert final.content == content
    assert [c.name for c in final.tool_calls] == [n for n, _ in calls]
    for call, (_, args) in zip(final.tool_calls, calls):
        assert json.loads(call.arguments) == args
    for sizes in chunkings(text, 60, seed=len(text)):
        check_stream(stream_in(parser.stream(), text, sizes), final)


def scans_streaming(monkeypatch, name: str, text: str) -> tuple[int, ParsedOutput]:
    """`text` streamed through parser `name` 4 characters at a time: how many full JSON value
    scans (`json_scan.value_end` calls) it took, and the result."""
    import ksana_llm.server.tool_parsers.json_scan as json_scan

    count = 0
    real = json_scan.value_end

    def counting(text, pos):
        nonlocal count
        count += 1
        return real(text, pos)

    monkeypatch.setattr(json_scan, "value_end", counting)
    try:
        final = collect(stream_in(get_tool_parser(name).stream(), text, [4] * (len(text) // 4 + 1)))
    finally:
        monkeypatch.setattr(json_scan, "value_end", real)
    return count, final


def function_tool(name: str, properties: dict) -> dict:
    """A request's function tool whose parameters are an object of `properties`."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties}}}
