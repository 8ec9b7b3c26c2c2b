"""A request's thinking token budget (vLLM's `thinking_token_budget`) and structured output
after the thinking block, on the default model against transformers' greedy tokens: the block
runs free until the budget is spent, then its end tag is forced and greedy decoding goes on
from there as transformers would from the same ids."""

from __future__ import annotations

import json

import pytest
import torch

import ksana_llm as kt
from ksana_llm.structured.thinking import ThinkingGate, ThinkingMarkers, ThinkingState

THINK = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
OPENED = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
NEUTRAL = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
JSON_OUTPUT = {"kind": "json_schema", "value": json.dumps(SCHEMA)}


@pytest.fixture(scope="module")
def engine(default_model):
    eng = kt.Engine(default_model, num_device_blocks=128, reasoning_config=THINK)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def end_ids(default_model):
    return default_model.tokenizer.encode("</think>", add_special_tokens=False)


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `ids` (stops at EOS, as the engine does)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def run(engine, prompt, **config):
    return engine.generate_outputs([prompt], kt.GenerationConfig(**config), use_tqdm=False)[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_spent_budget_forces_the_end_tag(default_model, hf_default_model, end_ids,
                                         async_scheduling):
    """The prompt opened the block: `budget` free tokens (transformers' greedy ones), the end
    tag's tokens, then transformers' greedy continuation of all of that."""
    eng = kt.Engine(default_model, num_device_blocks=128, reasoning_config=THINK,
                    async_scheduling=async_scheduling)
    try:
        prompt_ids = default_model.tokenizer.encode(OPENED)
        out = run(eng, OPENED, max_new_tokens=14, thinking_token_budget=5)
    finally:
        eng.shutdown()
    thought = hf_greedy(hf_default_model, prompt_ids, 5)
    rest = hf_greedy(hf_default_model, prompt_ids + thought + end_ids, 14 - 5 - len(end_ids))
    assert out.token_ids == thought + end_ids + rest
    assert "</think>" in out.text


def test_zero_budget_ends_the_block_at_once(engine, end_ids, hf_default_model, default_model):
    out = run(engine, OPENED, max_new_tokens=6, thinking_token_budget=0)
    prompt_ids = default_model.tokenizer.encode(OPENED)
    assert out.token_ids == end_ids + hf_greedy(hf_default_model, prompt_ids + end_ids,
                                                6 - len(end_ids))


def test_budget_without_a_block_changes_nothing(engine, hf_default_model, default_model):
    """The model never opens the block: the budget never applies."""
    out = run(engine, NEUTRAL, max_new_tokens=10, thinking_token_budget=1)
    assert out.token_ids == hf_greedy(hf_default_model, default_model.tokenizer.encode(NEUTRAL), 10)


def test_a_block_the_model_opens_is_found_by_its_text(default_model, hf_default_model):
    """The start text spelt over two tokens of the model's own output opens the block there;
    the budget counts from the token after it."""
    tokenizer = default_model.tokenizer
    prompt = "<|im_start|>user\nWrite a poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = tokenizer.encode(prompt)
    plain = hf_greedy(hf_default_model, prompt_ids, 12)
    start = tokenizer.decode(plain[2:4])  # two tokens of the greedy answer
    assert len(tokenizer.encode(start, add_special_tokens=False)) > 1 and len(plain) == 12
    assert start not in tokenizer.decode(plain[:3])
    end_ids = tokenizer.encode("</think>", add_special_tokens=False)
    eng = kt.Engine(default_model, num_device_blocks=128,
                    reasoning_config={"reasoning_start_str": start, "reasoning_end_str": "</think>"})
    try:
        out = run(eng, prompt, max_new_tokens=12, thinking_token_budget=2)
    finally:
        eng.shutdown()
    head = plain[:6]  # the tokens up to the start text, then two thought
    rest = hf_greedy(hf_default_model, prompt_ids + head + end_ids, 12 - 6 - len(end_ids))
    assert out.token_ids == head + end_ids + rest


def test_structured_output_constrains_the_answer_after_the_block(engine, end_ids, default_model):
    """The thinking is free; the JSON follows the forced end tag, and it is what the grammar
    alone gives from the same ids."""
    out = run(engine, OPENED, max_new_tokens=40, thinking_token_budget=6,
              structured_output=JSON_OUTPUT)
    assert out.token_ids[6:6 + len(end_ids)] == end_ids
    answer = out.text.split("</think>", 1)[1]
    assert set(json.loads(answer)) == {"answer"}
    prompt_ids = default_model.tokenizer.encode(OPENED)
    after = run(engine, prompt_ids + out.token_ids[:6 + len(end_ids)], max_new_tokens=40,
                structured_output=JSON_OUTPUT)
    assert out.token_ids[6 + len(end_ids):] == after.token_ids


def test_a_prompt_that_closed_the_block_gets_the_grammar_at_once(engine):
    """Thinking turned off (`<think>\\n\\n</think>\\n\\n`): the output is the JSON alone."""
    out = run(engine, NEUTRAL + "<think>\n\n</think>\n\n", max_new_tokens=30,
              structured_output=JSON_OUTPUT)
    assert set(json.loads(out.text)) == {"answer"}


def test_a_one_token_start_tag_may_open_the_block_before_the_grammar(default_model):
    """With a start tag that is one token, the first token may open the block beside the
    grammar's choices (a logit bias makes the model take it); a prompt that closed the block
    leaves the grammar alone, so the same bias cannot win."""
    tokenizer = default_model.tokenizer
    start, end = tokenizer.encode("<filename>", add_special_tokens=False), \
        tokenizer.encode("<gh_stars>", add_special_tokens=False)
    assert len(start) == len(end) == 1
    eng = kt.Engine(default_model, num_device_blocks=128,
                    reasoning_config={"reasoning_start_str": "<filename>",
                                      "reasoning_end_str": "<gh_stars>"})
    try:
        config = dict(max_new_tokens=30, thinking_token_budget=3, structured_output=JSON_OUTPUT,
                      logit_bias={start[0]: 100.0}, skip_special_tokens=False)
        opened = run(eng, NEUTRAL, **config)
        closed = run(eng, NEUTRAL + "<filename><gh_stars>", **config)
    finally:
        eng.shutdown()
    assert opened.token_ids[:5] == start * 4 + end  # the tag, 3 thought (biased), the end
    assert set(json.loads(opened.text.split("<gh_stars>", 1)[1])) == {"answer"}
    assert start[0] not in closed.token_ids and set(json.loads(closed.text)) == {"answer"}


def test_parallel_samples_each_keep_their_budget(engine, end_ids):
    out = engine.generate_outputs([OPENED], kt.GenerationConfig(
        max_new_tokens=12, thinking_token_budget=4, do_sample=True, seed=7,
        num_return_sequences=3), use_tqdm=False)[0]
    assert len(out.sequences) == 3
    for sequence in out.sequences:
        assert sequence.token_ids[4:4 + len(end_ids)] == end_ids


def test_bad_budgets_and_configs_name_their_field(default_model, engine):
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="thinking_token_budget"):
            kt.GenerationConfig(thinking_token_budget=bad)
    with pytest.raises(ValueError, match="thinking_token_budget"):
        kt.GenerationConfig(thinking_token_budget=4, num_beams=2)
    with pytest.raises(ValueError, match="reasoning_start_str"):
        kt.EngineConfig(reasoning_config={"reasoning_start_str": "", "reasoning_end_str": "x"})
    plain = kt.Engine(default_model, num_device_blocks=32)
    try:
        with pytest.raises(ValueError, match="^thinking_token_budget: .*reasoning_config"):
            plain.generate(OPENED, kt.GenerationConfig(max_new_tokens=2, thinking_token_budget=1))
        plain.set_reasoning_config(THINK)  # what build_app does for its reasoning parser
        assert plain.config.reasoning_config.reasoning_end_str == "</think>"
        assert len(plain.generate_outputs([OPENED], kt.GenerationConfig(
            max_new_tokens=4, thinking_token_budget=1), use_tqdm=False)[0].token_ids) == 4
    finally:
        plain.shutdown()
    assert engine.generate(NEUTRAL, kt.GenerationConfig(max_new_tokens=2))  # still serving


@pytest.mark.parametrize("tail, state", [
    (OPENED, ThinkingState.THINKING),
    (NEUTRAL + "<think>\nLet me see", ThinkingState.THINKING),  # a prefilled thought
    (NEUTRAL + "<think>\n\n</think>\n\n", ThinkingState.AFTER),
    ("<|im_start|>assistant\n<think>x</think>4<|im_end|>\n" + NEUTRAL, ThinkingState.BEFORE),
    (NEUTRAL, ThinkingState.BEFORE)])
def test_where_a_prompt_leaves_the_block(default_model, tail, state):
    tokenizer = default_model.tokenizer
    markers = ThinkingMarkers.from_tokenizer(tokenizer, "<think>", "</think>")
    assert markers.prompt_state(tokenizer.encode(tail)) is state


def test_a_budget_spent_inside_the_end_tag_finishes_it(default_model, end_ids):
    """The model had begun `</think>` itself when the budget ran out: the gate forces the rest
    of it, not the whole tag again."""
    tokenizer = default_model.tokenizer
    markers = ThinkingMarkers.from_tokenizer(tokenizer, "<think>", "</think>")
    assert len(end_ids) > 1
    gate = ThinkingGate(markers, ThinkingState.THINKING, budget=3)
    for token in tokenizer.encode(" Four", add_special_tokens=False)[:1] + [end_ids[0]]:
        gate.accept_token(token)
    assert gate.forcing is None
    gate.accept_token(end_ids[1])  # the third token of the block, and the tag's second
    assert gate.forcing == 2 and gate.state is ThinkingState.THINKING
    mask = torch.full((1, (default_model.vocab_size + 31) // 32), -1, dtype=torch.int32)
    gate.fill_bitmask(mask, 0)
    allowed = [t for t in range(mask.shape[1] * 32) if (mask[0, t // 32] >> (t % 32)) & 1]
    assert allowed == [end_ids[2]]
    gate.accept_token(end_ids[2])
    assert gate.state is ThinkingState.AFTER


@pytest.mark.parametrize("prompt_end, output", [
    ("</", "think>"),  # the end tag: begun by the prompt, finished by the output
    ("</th", "ink>"),
])
def test_a_tag_the_prompt_begins_and_the_output_finishes(default_model, prompt_end, output):
    from ksana_llm.structured.thinking import thinking_gate

    tokenizer = default_model.tokenizer
    markers = ThinkingMarkers.from_tokenizer(tokenizer, "<think>", "</think>")
    prompt = tokenizer.encode(OPENED + "Four." + prompt_end)
    gate = thinking_gate(markers, prompt, budget=10)
    assert gate.state is ThinkingState.THINKING
    for token in tokenizer.encode(output, add_special_tokens=False):
        gate.accept_token(token)
    assert gate.state is ThinkingState.AFTER and gate.forcing is None
    # A prompt whose tail holds a whole tag already is not read twice: after the block closed,
    # the start tag inside that tail does not open another one.
    closed = thinking_gate(markers, tokenizer.encode(NEUTRAL + "<think>\n\n</think>\n\n"))
    assert closed.state is ThinkingState.AFTER
    closed.accept_token(tokenizer.encode("The", add_special_tokens=False)[0])
    assert closed.state is ThinkingState.AFTER


def test_a_prompt_ending_inside_the_end_tag_gets_the_grammar_after_it(engine, default_model):
    """The prompt ends with `</`, the model writes `think>`: no second end tag is forced, and the
    JSON follows at once."""
    out = run(engine, OPENED + "Four.</", max_new_tokens=20, thinking_token_budget=3,
              structured_output=JSON_OUTPUT)
    assert out.text.startswith("think>") and "</think>" not in out.text
    assert set(json.loads(out.text.removeprefix("think>"))) == {"answer"}


def test_a_zero_budget_finishes_an_end_tag_the_prompt_began(default_model, end_ids):
    from ksana_llm.structured.thinking import thinking_gate

    tokenizer = default_model.tokenizer
    markers = ThinkingMarkers.from_tokenizer(tokenizer, "<think>", "</think>")
    gate = thinking_gate(markers, tokenizer.encode(OPENED + "Four.</"), budget=0)
    assert gate.forcing == 1  # "</" is the prompt's: only "think>" is forced
    for token in end_ids[1:]:
        gate.accept_token(token)
    assert gate.state is ThinkingState.AFTER
    assert thinking_gate(markers, tokenizer.encode(OPENED + "Four."), budget=0).forcing == 0
