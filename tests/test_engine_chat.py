"""`Engine.chat` (vLLM's `LLM.chat`) on the real default model: conversations rendered with the
model's chat template give transformers' greedy answers to the same rendered prompts, batched or
alone; `continue_final_message`, a given template and template kwargs reach the template; bad
conversations are ValueErrors naming the argument, and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from tests.engine_fixtures import engine_fixture

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a color of the sky."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "And of grass?"}],
]


engine = engine_fixture(num_device_blocks=128)


def _hf_greedy(hf, tokenizer, text: str, new_tokens: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                          max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def test_answers_equal_transformers(engine, hf_default_model, default_model):
    tokenizer = default_model.tokenizer
    config = kt.GenerationConfig(max_new_tokens=20)
    expected = [_hf_greedy(hf_default_model, tokenizer, tokenizer.apply_chat_template(
        c, add_generation_prompt=True, tokenize=False), 20) for c in CONVERSATIONS]
    batched = engine.chat(CONVERSATIONS, config, use_tqdm=False)
    assert [o.text for o in batched] == expected
    alone = engine.chat(CONVERSATIONS[1], config)  # one conversation: still a list
    assert len(alone) == 1 and alone[0].text == expected[1]
    assert engine.render_chat(CONVERSATIONS[0]) == tokenizer.encode(
        tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True,
                                      tokenize=False), add_special_tokens=False)


def test_template_options_reach_the_template(engine, hf_default_model, default_model):
    tokenizer = default_model.tokenizer
    started = CONVERSATIONS[0] + [{"role": "assistant", "content": "The capital of France"}]
    text = tokenizer.apply_chat_template(started, continue_final_message=True, tokenize=False)
    out = engine.chat(started, kt.GenerationConfig(max_new_tokens=8), add_generation_prompt=False,
                      continue_final_message=True)[0]
    assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert out.text == _hf_greedy(hf_default_model, tokenizer, text, 8)
    # A final user message continues as well (transformers' rule, and vLLM's): left open.
    assert engine.render_chat(CONVERSATIONS[0], add_generation_prompt=False,
                              continue_final_message=True) == tokenizer.encode(
        tokenizer.apply_chat_template(CONVERSATIONS[0], continue_final_message=True,
                                      tokenize=False), add_special_tokens=False)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ suffix }}{% endfor %}"
    ids = engine.render_chat(CONVERSATIONS[0], chat_template=template,
                             add_generation_prompt=False, chat_template_kwargs={"suffix": "!"})
    assert tokenizer.decode(ids) == "<user>What is the capital of France?!"


@pytest.mark.parametrize("messages, kwargs, needle", [
    ([], {}, "messages"),
    ([[]], {}, "messages"),
    ([{"content": "no role"}], {}, "messages\\[0\\]"),
    ("hello", {}, "messages"),
    (CONVERSATIONS[0], {"continue_final_message": True}, "continue_final_message"),
    (CONVERSATIONS[0], {"chat_template": "{{ raise_exception('no') }}"}, "messages"),
    (CONVERSATIONS[0], {"chat_template": "{% if false %}x{% endif %}"}, "empty prompt"),
    # apply_chat_template's own arguments (a TypeError for a duplicate keyword, unchecked)
    (CONVERSATIONS[0], {"chat_template_kwargs": {"tokenize": True}}, "cannot set tokenize"),
])
def test_bad_conversations_are_value_errors(engine, messages, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        engine.chat(messages, **kwargs)
    assert engine.chat(CONVERSATIONS[0], kt.GenerationConfig(max_new_tokens=2))[0].token_ids
