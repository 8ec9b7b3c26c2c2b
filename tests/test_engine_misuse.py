"""The Python API used the ways real callers misuse its inputs, on the real default model:
settings of the wrong type or changed after a config was built, names transformers has and we
lack, configs beam search cannot finish, request ids, and prompts as numpy arrays, torch tensors
or tuples. Each must give a clear error naming the field, or a finished request.

Requests' lifecycle (streams left early, aborts, callbacks, asyncio handles) is in
test_engine_request_lifecycle.py; the engine thread's own failures in test_engine_thread.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ksana_llm as kt
from tests.engine_fixtures import engine_fixture, wait_until_idle

PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


engine = engine_fixture(generation_config=kt.GenerationConfig(max_new_tokens=8),
                        num_device_blocks=256)


@pytest.mark.parametrize("config, field", [
    ({"skip_special_tokens": 0}, "skip_special_tokens"),  # killed the engine thread once
    ({"do_sample": "no"}, "do_sample"),
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"temperature": float("inf")}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"num_beams": 2, "length_penalty": float("-inf")}, "length_penalty"),
    ({"num_beams": 2, "early_stopping": 1.0}, "early_stopping"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"logit_bias": {"²": 1.0}}, "logit_bias"),
])
def test_settings_of_the_wrong_type_are_refused_by_name(engine, config, field):
    other = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=12, ignore_eos=True)))
    with pytest.raises(ValueError, match=field):
        kt.GenerationConfig(**config)
    with pytest.raises(ValueError, match=field):
        engine.generate(PROMPT, config)
    assert len(other.result(timeout=60).token_ids) == 12 and engine.is_running


@pytest.mark.parametrize("field, value", [
    ("stop", ["Paris", ""]), ("stop", ("Paris", 5)), ("seed", 1.5), ("stop_token_ids", 5), ("max_new_tokens", None),
    ("max_new_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("num_beams", 0),
    ("logprobs", 10**6), ("skip_special_tokens", 1),
])
def test_a_config_changed_after_it_was_built_is_checked_again(engine, field, value):
    """transformers validates a GenerationConfig on every generate(); so does submit. Set on the
    engine's default config, the same value is refused for every request that uses it."""
    config = kt.GenerationConfig(max_new_tokens=4, do_sample=True)
    setattr(config, field, value)
    other = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=12, ignore_eos=True)))
    with pytest.raises(ValueError, match=field):
        engine.generate(PROMPT, config)
    with pytest.raises(ValueError, match=field):
        engine.submit(kt.Request(PROMPT, config))
    assert len(other.result(timeout=60).token_ids) == 12 and engine.is_running


def test_a_lone_stop_string_or_tuples_set_after_construction_work_as_in_the_constructor(engine):
    """The constructor takes stop="x" and tuples; so does a config changed afterwards (the
    request's copy normalises them), and the caller's config is left as the caller set it."""
    def run(config: kt.GenerationConfig) -> kt.RequestOutput:
        return engine.submit(kt.Request(PROMPT, config)).result(timeout=60)

    text = run(kt.GenerationConfig(max_new_tokens=8)).text
    word = text.split()[2]  # a word from the middle of the greedy answer
    built = run(kt.GenerationConfig(max_new_tokens=8, stop=word))
    changed = kt.GenerationConfig(max_new_tokens=8)
    changed.stop, changed.stop_token_ids = word, (0,)  # token 0 is not in this answer
    answer = run(changed)
    assert answer.finish_reason == built.finish_reason == "stop"
    assert answer.text == built.text == text[:text.index(word)]
    assert changed.stop == word and changed.stop_token_ids == (0,)


def test_numpy_token_ids_are_taken_in_every_token_id_field():
    ids = np.array([5, 6], dtype=np.int64)
    config = kt.GenerationConfig(bad_words_ids=[list(ids)], allowed_token_ids=list(ids),
                                 logit_bias={ids[0]: np.float32(1.5)}, stop_token_ids=list(ids))
    assert config.bad_words_ids == [[5, 6]] and config.allowed_token_ids == [5, 6]
    assert config.logit_bias == {5: 1.5} and config.stop_token_ids == [5, 6]
    assert all(type(t) is int for t in [*config.allowed_token_ids, *config.logit_bias])


def test_transformers_names_we_lack_are_value_errors_and_configs_may_come_as_a_tuple(engine):
    for name in ("max_length", "stop_strings", "pad_token_id"):
        with pytest.raises(ValueError, match=f"unknown generation parameter.*{name}"):
            kt.GenerationConfig(**{name: 5})
    configs = (kt.GenerationConfig(max_new_tokens=2), kt.GenerationConfig(max_new_tokens=3))
    outs = engine.generate_outputs([PROMPT, PROMPT], configs, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [2, 3]


def test_a_priority_the_fifo_scheduler_would_ignore_is_refused(engine):
    """As vLLM: a priority needs scheduler="priority"; 0 (the default) is fine."""
    with pytest.raises(ValueError, match="priority 3 needs an engine with scheduler='priority'"):
        engine.submit(kt.Request(PROMPT, priority=3))
    assert engine.submit(kt.Request(PROMPT, priority=0)).result(timeout=60).token_ids


def test_engine_default_config_as_a_dict_or_of_the_wrong_type(default_model):
    with kt.Engine(default_model, generation_config={"max_new_tokens": 3, "ignore_eos": True},
                   num_device_blocks=32) as engine:
        assert len(engine.generate_outputs(PROMPT, use_tqdm=False)[0].token_ids) == 3
    for bad, match in (("greedy", "generation_config"), ({"max_new_tokenz": 3}, "max_new_tokenz")):
        with pytest.raises(ValueError, match=match):
            kt.Engine(default_model, generation_config=bad, num_device_blocks=32)


@pytest.mark.parametrize("config", [
    # Every finished hypothesis scores below transformers' -1e9 filler.
    kt.GenerationConfig(max_new_tokens=12, num_beams=2, length_penalty=-20.0, ignore_eos=True),
])
def test_beam_search_always_finishes_with_an_answer(engine, config):
    out = engine.submit(kt.Request("Write a long story about a dragon.", config)).result(timeout=120)
    assert out.finished and out.token_ids and len(out.sequences) == 1
    assert wait_until_idle(engine)


@pytest.mark.parametrize("config", [
    # The only allowed token is EOS, which min_new_tokens holds back (token 0 came out).
    {"allowed_token_ids": [2], "min_new_tokens": 2},
    {"allowed_token_ids": [2], "min_new_tokens": 2, "num_beams": 2},
    {"allowed_token_ids": [578, 2], "bad_words_ids": [[578]], "min_new_tokens": 3},
    {"allowed_token_ids": [578, 11], "stop_token_ids": [11], "bad_words_ids": [[578]],
     "min_new_tokens": 1, "ignore_eos": True},
])
def test_allowed_tokens_that_min_new_tokens_all_holds_back_are_refused(engine, config):
    with pytest.raises(ValueError, match="allowed_token_ids .* nothing could be generated"):
        engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=4, **config)))
    # Ignoring EOS, it may be generated: no refusal, and only allowed ids come out.
    out = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(
        max_new_tokens=3, allowed_token_ids=[2], min_new_tokens=2, ignore_eos=True))).result(60)
    assert out.token_ids == [2, 2, 2]


def test_a_lone_eos_bad_word_bans_nothing_when_eos_is_ignored(engine, default_model):
    """transformers' rule held only while the request stopped at EOS."""
    eos = default_model.eos_token_ids[0]
    config = kt.GenerationConfig(max_new_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    plain = engine.submit(kt.Request(PROMPT, config)).result(timeout=60)
    banned = engine.submit(kt.Request(PROMPT, config.replace(bad_words_ids=[[eos]]))).result(60)
    assert plain.token_ids == banned.token_ids == [eos] * 3


@pytest.mark.parametrize("request_id", ["", 7])
def test_request_ids_are_non_empty_strings(engine, request_id):
    with pytest.raises(ValueError, match="request_id"):
        engine.submit(kt.Request(PROMPT, request_id=request_id))


def test_prompts_as_numpy_arrays_torch_tensors_and_tuples(engine):
    ids = engine.tokenizer.encode(PROMPT)
    expected = engine.generate(ids)
    assert engine.generate(np.array(ids)) == expected
    assert engine.generate(torch.tensor(ids)) == expected
    assert engine.generate(tuple(ids)) == expected
    assert engine.generate(torch.tensor([ids, ids]), use_tqdm=False) == [expected, expected]
    # numpy scalars in a config are numbers like any other.
    config = kt.GenerationConfig(max_new_tokens=np.int64(8), temperature=np.float32(1.0))
    assert engine.generate(ids, config) == expected
    for bad in (np.array(ids, dtype=np.float32), torch.tensor([True, False]), np.array([], dtype=np.int64)):
        with pytest.raises(ValueError, match="prompt"):
            engine.generate(bad)


def test_a_vanishing_temperature_is_greedy(engine):
    greedy = engine.generate(PROMPT)
    tiny = kt.GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1e-38, seed=1)
    assert engine.generate(PROMPT, tiny) == greedy


def test_chat_template_kwargs_must_be_a_dict(engine):
    conversation = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        engine.chat(conversation, chat_template_kwargs=5)


def test_engine_settings_are_named_as_given(default_model):
    """A bad Engine keyword is a ValueError naming it as the caller spelled it (the KTransformers
    guide's max_batch_size, not the config field behind it), without pydantic's links."""
    for kwargs, name in (({"max_batch_size": 0}, "max_batch_size"),
                         ({"max_num_seqs": 0}, "max_num_seqs"),
                         ({"max_queue_size": -1}, "max_queue_size")):
        with pytest.raises(ValueError, match=f"^{name}: ") as info:
            kt.Engine(default_model, num_device_blocks=16, **kwargs)
        assert "pydantic" not in str(info.value)


def test_generate_of_several_sequences_is_refused_before_it_runs(engine):
    """generate() answers one text per prompt: a request for n > 1 would lose the rest unseen,
    so it is a ValueError naming the field before anything is queued; generate_outputs
    returns them all."""
    config = kt.GenerationConfig(max_new_tokens=3, num_return_sequences=2, do_sample=True,
                                 seed=2)
    finished = engine.stats().num_finished
    for prompts in (PROMPT, [PROMPT, "Hello"]):
        with pytest.raises(ValueError, match=r"num_return_sequences: .*generate_outputs\(\)"):
            engine.generate(prompts, config)
    assert engine.stats().num_finished == finished
    out = engine.generate_outputs(PROMPT, config, use_tqdm=False)[0]
    assert len(out.sequences) == 2

