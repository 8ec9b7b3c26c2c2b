"""GPT-OSS's harmony format under the thinking gate (the `openai_gptoss` parser's
reasoning_config): every channel before the final one is thought, so structured output
constrains the final channel only (as vLLM does), and a spent thinking budget ends the message
it is in and opens the final channel. On the default model, whose tokenizer spells harmony's
markers over several tokens: the gate finds them by their text."""

from __future__ import annotations

import json

import pytest

import ksana_llm as kt
from ksana_llm.server.reasoning_parsers import get_reasoning_parser
from ksana_llm.structured.thinking import ThinkingGate, ThinkingMarkers, ThinkingState

HARMONY = get_reasoning_parser("openai_gptoss").reasoning_config()
FINAL = "<|channel|>final<|message|>"
PROMPT = "<|start|>user<|message|>What is 2+2? Answer in JSON.<|end|><|start|>assistant"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
JSON_OUTPUT = {"kind": "json_schema", "value": json.dumps(SCHEMA)}


@pytest.fixture(scope="module")
def engine(default_model):
    with kt.Engine(default_model, num_device_blocks=128, reasoning_config=HARMONY) as eng:
        yield eng


@pytest.fixture(scope="module")
def markers(default_model):
    return ThinkingMarkers.from_tokenizer(default_model.tokenizer, HARMONY["reasoning_start_str"],
                                          HARMONY["reasoning_end_str"],
                                          HARMONY["reasoning_end_tag"])


def run(engine, prompt, **config):
    return engine.generate_outputs([prompt], kt.GenerationConfig(**config), use_tqdm=False)[0]


def test_spent_budget_opens_the_final_channel_for_the_grammar(engine, default_model):
    """Four free tokens of thought, the forced end of the message and the final channel's
    header, then the JSON: what the grammar alone gives from the same ids."""
    forced = default_model.tokenizer.encode(HARMONY["reasoning_end_str"], add_special_tokens=False)
    out = run(engine, PROMPT, max_new_tokens=60, thinking_token_budget=4,
              structured_output=JSON_OUTPUT)
    assert out.token_ids[4:4 + len(forced)] == forced
    assert set(json.loads(out.text.split(FINAL, 1)[1])) == {"answer"}
    prompt_ids = default_model.tokenizer.encode(PROMPT)
    after = run(engine, prompt_ids + out.token_ids[:4 + len(forced)], max_new_tokens=60,
                structured_output=JSON_OUTPUT)
    assert out.token_ids[4 + len(forced):] == after.token_ids


def test_a_prompt_in_the_final_channel_gets_the_grammar_at_once(engine):
    out = run(engine, PROMPT + "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant"
              + FINAL, max_new_tokens=30, structured_output=JSON_OUTPUT)
    assert set(json.loads(out.text)) == {"answer"}


def test_the_final_header_the_model_writes_ends_the_thought(default_model, markers):
    """Fed harmony's analysis message and the final header token by token, the gate lets every
    token through (no budget) and leaves the thought at the header's last token."""
    tokenizer = default_model.tokenizer
    gate = ThinkingGate(markers, markers.prompt_state(tokenizer.encode(PROMPT)))
    assert gate.state is ThinkingState.THINKING
    thought = tokenizer.encode("<|channel|>analysis<|message|>Two and two.<|end|>"
                               "<|start|>assistant" + FINAL, add_special_tokens=False)
    for i, token in enumerate(thought):
        assert gate.state is ThinkingState.THINKING, i
        assert gate.accept_token(token)
    assert gate.state is ThinkingState.AFTER


@pytest.mark.parametrize("tail, state", [
    (PROMPT, ThinkingState.THINKING),
    # Earlier turns' final answers do not close the new turn's thought.
    ("<|start|>assistant" + FINAL + "4<|return|><|start|>user<|message|>And 3+3?<|end|>"
     "<|start|>assistant", ThinkingState.THINKING),
    (PROMPT + FINAL, ThinkingState.AFTER),
    (PROMPT + "<|channel|>analysis<|message|>Let me see", ThinkingState.THINKING)])
def test_where_a_harmony_prompt_leaves_the_thought(default_model, markers, tail, state):
    assert markers.prompt_state(default_model.tokenizer.encode(tail)) is state
