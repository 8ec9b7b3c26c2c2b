"""Reasoning parsers: `<think>...</think>` split into reasoning and content, non-streamed and
streamed in random chunkings (every chunking must give the non-streamed answer, and no half tag
may be sent as text)."""

from __future__ import annotations

import random

import pytest

from ksana_llm.server.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningOutput,
    get_reasoning_parser,
    opens_thinking,
)
from tests.tool_parser_harness import stream_in

THOUGHT = "The user asks for the capital of France.\nThat is Paris; answer briefly."
ANSWER = "The capital of France is Paris."

# (parser, output, reasoning, content)
CASES = [
    ("qwen3", f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}", f"\n{THOUGHT}\n", ANSWER),
    ("qwen3", ANSWER, None, ANSWER),  # enable_thinking off, or a direct answer
    ("qwen3", f"  <think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    ("qwen3", f"{ANSWER} <think> is a tag", None, f"{ANSWER} <think> is a tag"),
    ("qwen3", f"<think>{THOUGHT}", THOUGHT, None),  # cut off while thinking
    ("qwen3", "<think></think>\n\n" + ANSWER, None, ANSWER),
    # DeepSeek-R1: the template opened the block; the output starts inside it.
    ("deepseek_r1", f"{THOUGHT}\n</think>\n\n{ANSWER}", f"{THOUGHT}\n", ANSWER),
    ("deepseek_r1", f"<think>\n{THOUGHT}</think>{ANSWER}", f"\n{THOUGHT}", ANSWER),
    ("deepseek_r1", THOUGHT, THOUGHT, None),  # no end yet: all reasoning
    ("deepseek_r1", f"{THOUGHT}</think>", THOUGHT, None),
    # DeepSeek-V3.1 without thinking (its prompt ends with "</think>"): the output is the answer.
    ("deepseek_v3", ANSWER, None, ANSWER),
    ("deepseek_v3", f"<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    # GLM-4.5 opens the block itself; with thinking off its prompt holds an empty one.
    ("glm45", f"<think>{THOUGHT}</think>\n{ANSWER}", THOUGHT, ANSWER),
    ("glm45", f"\n{ANSWER}", None, f"\n{ANSWER}"),
    # Seed-OSS: its own tags; <think> is text to it.
    ("seed_oss", f"<seed:think>{THOUGHT}</seed:think>\n\n{ANSWER}", THOUGHT, ANSWER),
    ("seed_oss", f"<think>{THOUGHT}</think>{ANSWER}", None, f"<think>{THOUGHT}</think>{ANSWER}"),
    ("seed_oss", f"<seed:think>{THOUGHT}", THOUGHT, None),
    # Hunyuan-A13B: the answer in <answer> tags, which (with the newlines inside) are no content;
    # an answer cut off before its close tag; one without a thinking block.
    ("hunyuan_a13b", f"<think>\n{THOUGHT}\n</think>\n<answer>\n{ANSWER}\n</answer>", f"\n{THOUGHT}\n",
     ANSWER),
    ("hunyuan_a13b", f"<think>{THOUGHT}</think>\n<answer>\n{ANSWER}", THOUGHT, ANSWER),
    ("hunyuan_a13b", f"<answer>\n{ANSWER}\n</answer>", None, ANSWER),
    ("hunyuan_a13b", ANSWER, None, ANSWER),
    ("hunyuan_a13b", f"<think>{THOUGHT}</think><answer>A <b> </answ", THOUGHT, "A <b> </answ"),
    # Magistral: [THINK]...[/THINK], opened by the model; other models' tags are text to it.
    ("mistral", f"[THINK]{THOUGHT}[/THINK]\n\n{ANSWER}", THOUGHT, ANSWER),
    ("mistral", f"\n[THINK]\n{THOUGHT}\n[/THINK]{ANSWER}", f"\n{THOUGHT}\n", ANSWER),
    ("mistral", ANSWER, None, ANSWER),
    ("mistral", f"[THINK]{THOUGHT}", THOUGHT, None),
    ("mistral", f"<think>{THOUGHT}</think>{ANSWER}", None, f"<think>{THOUGHT}</think>{ANSWER}"),
    ("mistral", f"{ANSWER} [THINK] is a tag", None, f"{ANSWER} [THINK] is a tag"),
    # Step-3 and MiniMax-M2: the output starts inside the block, which only </think> ends.
    ("step3", f"{THOUGHT}\n</think>\n\n{ANSWER}", f"{THOUGHT}\n", ANSWER),
    ("step3", THOUGHT, THOUGHT, None),
    ("step3", f"</think>{ANSWER}", None, ANSWER),
    ("minimax_m2", f"\n{THOUGHT}</think>\n\n{ANSWER}", f"\n{THOUGHT}", ANSWER),
    ("minimax_m2", THOUGHT, THOUGHT, None),
    ("minimax_m2", f"{THOUGHT}</think>\n<minimax:tool_call>\n<invoke name=\"f\">",
     THOUGHT, "<minimax:tool_call>\n<invoke name=\"f\">"),
    # MiniMax-M2, append_think: no split; the prompt's <think> goes before the output.
    ("minimax_m2_append_think", f"\n{THOUGHT}\n</think>\n\n{ANSWER}", None,
     f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"),
    ("minimax_m2_append_think", THOUGHT, None, f"<think>{THOUGHT}"),
    ("minimax_m2_append_think", "", None, None),
    # ERNIE-4.5-Thinking: starts in the block; the answer may sit in <response> tags.
    ("ernie45", f"{THOUGHT}\n</think>\n\n<response>\n{ANSWER}\n</response>\n", f"{THOUGHT}\n",
     ANSWER),
    ("ernie45", f"<think>{THOUGHT}</think>\n{ANSWER}", THOUGHT, ANSWER),
    ("ernie45", f"{THOUGHT}\n</think>\n\n{ANSWER}\n", f"{THOUGHT}\n", f"{ANSWER}\n"),
    ("ernie45", THOUGHT, THOUGHT, None),
    ("ernie45", f"{THOUGHT}</think><response>\n{ANSWER}", THOUGHT, ANSWER),  # cut off
    # Olmo 3 Think: as Qwen3.
    ("olmo3", f"<think>{THOUGHT}</think>\n\n{ANSWER}", THOUGHT, ANSWER),
    ("olmo3", ANSWER, None, ANSWER),
    ("olmo3", f"<think>{THOUGHT}", THOUGHT, None),
    # Granite 3.2: two sentences, "Here is" or "Here's", mark the thoughts and the response.
    ("granite", f"Here is my thought process:\n{THOUGHT}\n\nHere is my response:\n{ANSWER}",
     f"\n{THOUGHT}\n\n", ANSWER),
    ("granite", f"Here's my thought process:\n{THOUGHT}\nHere's my response:\n{ANSWER}",
     f"\n{THOUGHT}\n", ANSWER),
    ("granite", f" \nHere's my thought process: {THOUGHT} Here is my response: {ANSWER}",
     f" {THOUGHT} ", ANSWER),
    ("granite", f"Here is my thought process:\n{THOUGHT}", f"\n{THOUGHT}", None),  # cut off
    ("granite", ANSWER, None, ANSWER),
    ("granite", f"Here is my answer: {ANSWER}", None, f"Here is my answer: {ANSWER}"),
    ("granite", f"{ANSWER} Here is my thought process: no.", None,
     f"{ANSWER} Here is my thought process: no."),
    ("granite", "Here is my", None, "Here is my"),
]


def _streamed(name: str, text: str, sizes: list[int], opened: bool = False
              ) -> tuple[ReasoningOutput, list]:
    deltas = stream_in(get_reasoning_parser(name).stream(opened), text, sizes)
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return ReasoningOutput(reasoning or None, content or None), deltas


@pytest.mark.parametrize("name,text,reasoning,content", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_split_streamed_and_not(name, text, reasoning, content):
    final = get_reasoning_parser(name).extract(text)
    assert final == ReasoningOutput(reasoning, content)
    rng = random.Random(len(text))
    chunkings = [[1] * len(text), []]
    for _ in range(80):
        chunkings.append([rng.randint(1, 9) for _ in range(len(text) // 4 + 1)])
    for sizes in chunkings:
        got, deltas = _streamed(name, text, sizes)
        assert got == final, sizes
        if "<" not in (final.reasoning or "") + (final.content or ""):
            assert not any("<" in d.reasoning or "<" in d.content for d in deltas)


def test_reasoning_streams_before_the_end_tag():
    stream = get_reasoning_parser("qwen3").stream()
    first = stream.feed("<think>Paris is the")
    assert first.reasoning == "Paris is the" and first.content == ""
    held = stream.feed(" capital.</th")  # "</th" may be the end tag: held back
    assert held.reasoning == " capital." and held.content == ""
    rest = stream.feed("ink>Paris.")
    assert rest.reasoning == "" and rest.content == "Paris."


def test_registry_names_and_unknown():
    assert set(REASONING_PARSERS) >= {"deepseek_r1", "qwen3", "mistral", "step3", "minimax_m2",
                                      "minimax_m2_append_think", "ernie45", "olmo3", "granite"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'.*deepseek_r1.*qwen3"):
        get_reasoning_parser("r2")


# (parser, output) when the prompt opened the thinking block (Qwen3-Thinking-2507's template
# ends with "<think>\n"): the output is reasoning until "</think>", for qwen3 as for deepseek_r1.
@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1", "deepseek_v3", "glm45", "seed_oss",
                                  "hunyuan_a13b", "mistral", "step3", "minimax_m2", "ernie45",
                                  "olmo3"])
@pytest.mark.parametrize("text,reasoning,content", [
    (f"{THOUGHT}\n</think>\n\n{ANSWER}", f"{THOUGHT}\n", ANSWER),
    (THOUGHT, THOUGHT, None),  # cut off while thinking
    (f"</think>{ANSWER}", None, ANSWER),
])
def test_prompt_that_opened_the_thinking_block(name, text, reasoning, content):
    end_tag = get_reasoning_parser(name).end_tag
    text = text.replace("</think>", end_tag)
    final = get_reasoning_parser(name).extract(text, prompt_opens_thinking=True)
    assert final == ReasoningOutput(reasoning, content)
    rng = random.Random(7)
    for _ in range(40):
        got, _ = _streamed(name, text, [rng.randint(1, 9) for _ in range(len(text) // 4 + 1)], True)
        assert got == final


def test_opens_thinking_reads_the_end_of_the_prompt():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not opens_thinking("<|im_start|>user\nWhat is <think>?<|im_end|>\n<|im_start|>assistant\n")
    # DeepSeek-V3.1's template with thinking on, then off.
    assert opens_thinking("<｜User｜>Hi<｜Assistant｜><think>")
    assert not opens_thinking("<｜User｜>Hi<｜Assistant｜></think>")
    # Each parser's own tag: Seed-OSS's.
    seed = get_reasoning_parser("seed_oss")
    assert seed.opens_thinking("<seed:bos>assistant\n<seed:think>")
    assert not seed.opens_thinking("<|im_start|>assistant\n<think>\n")
    assert get_reasoning_parser("qwen3").opens_thinking("<|im_start|>assistant\n<think>\n")
    # GLM-4.5's with thinking off.
    assert not opens_thinking("[gMASK]<sop><|user|>\nHi<|assistant|>\n<think></think>\n")


@pytest.mark.parametrize("name,tags", [
    ("mistral", ("[THINK]", "[/THINK]")),
    ("step3", ("<think>", "</think>")),
    ("minimax_m2", ("<think>", "</think>")),
    ("minimax_m2_append_think", ("<think>", "</think>")),
    ("ernie45", ("<think>", "</think>")),
    ("olmo3", ("<think>", "</think>")),
    ("granite", ("Here is my thought process:", "Here is my response:")),
])
def test_thinking_tags_of_the_other_formats(name, tags):
    assert get_reasoning_parser(name).thinking_tags() == tags


def test_which_prompts_open_the_other_formats_blocks():
    assert get_reasoning_parser("mistral").opens_thinking("[INST]Hi[/INST][THINK]")
    assert not get_reasoning_parser("mistral").opens_thinking("<|im_start|>assistant\n<think>\n")
    assert get_reasoning_parser("olmo3").opens_thinking("<|im_start|>assistant\n<think>")
    # Granite's template never leaves the thoughts open, whatever the prompt says.
    assert not get_reasoning_parser("granite").opens_thinking("Here is my thought process:")


def test_markers_are_held_back_not_sent():
    """A half-written marker that is not in the answer is never sent as text: Granite's
    sentences (either spelling) and Magistral's bracket tags."""
    stream = get_reasoning_parser("granite").stream()
    assert not stream.feed("  Here's my")
    first = stream.feed(" thought process: Paris is the capital. Here")
    assert first.reasoning == " Paris is the capital. " and first.content == ""
    held = stream.feed(" is my resp")  # may be "Here is my response:": held back
    assert not held
    rest = stream.feed("onse:\nParis.")
    assert rest.reasoning == "" and rest.content == "Paris."
    for name, text in [("granite", f"Here's my thought process: {THOUGHT} Here's my response: {ANSWER}"),
                       ("mistral", f"[THINK]{THOUGHT}[/THINK]{ANSWER}")]:
        deltas = stream_in(get_reasoning_parser(name).stream(), text, [1] * len(text))
        sent = "".join(d.reasoning + "|" + d.content for d in deltas)
        assert "Here" not in sent and "[" not in sent


def test_append_think_streams_the_prefix_once():
    stream = get_reasoning_parser("minimax_m2_append_think").stream(True)
    assert not stream.feed("")
    assert stream.feed("Paris").content == "<think>Paris"
    assert stream.feed("</think>").content == "</think>"
    assert not stream.finish()
