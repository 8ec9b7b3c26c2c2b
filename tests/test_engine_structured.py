"""Structured output through the engine on the real default model: the output validates against
the JSON schema (jsonschema) or matches the regex, and ends with finish_reason "stop"."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import ksana_llm as kt
from ksana_llm.generation_config import StructuredOutputSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population_millions", "capital"],
    "additionalProperties": False,
}
REGEX = r"(Paris|London|Rome), [0-9]{1,2} (million|thousand)"


def _chat(model, text: str) -> str:
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=False)


def test_json_schema_output_validates(default_model, local_engine):
    prompt = _chat(default_model, "Describe Paris as JSON with its city name, population in "
                                  "millions and whether it is a capital.")
    config = kt.GenerationConfig(max_new_tokens=60, structured_output=StructuredOutputSpec(
        "json_schema", json.dumps(SCHEMA)))
    free, out = local_engine.generate_outputs(
        [prompt, prompt], [kt.GenerationConfig(max_new_tokens=60), config], use_tqdm=False)
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.finish_reason == "stop" and out.token_ids[-1] in default_model.eos_token_ids
    assert out.stop_reason is None  # the model's end, as vLLM reports it
    # ignore_eos: the grammar still ends it (only EOS is allowed then), as the model's end.
    held = local_engine.generate_outputs(prompt, config.replace(ignore_eos=True), use_tqdm=False)[0]
    assert (held.text, held.finish_reason, held.stop_reason) == (out.text, "stop", None)
    with pytest.raises((ValueError, jsonschema.ValidationError)):  # the constraint did something
        jsonschema.validate(json.loads(free.text), SCHEMA)


def test_regex_and_json_object_with_several_samples(default_model, local_engine):
    prompt = _chat(default_model, "Which city is the capital of France, and how many people "
                                  "live there?")
    regex = kt.GenerationConfig(max_new_tokens=30, do_sample=True, seed=3, num_return_sequences=3,
                                structured_output=StructuredOutputSpec("regex", REGEX))
    obj = kt.GenerationConfig(max_new_tokens=40, structured_output={"kind": "json_object"})
    obj_prompt = _chat(default_model, "Give the capital of France as a JSON object with one key.")
    out, out_obj = local_engine.generate_outputs([prompt, obj_prompt], [regex, obj], use_tqdm=False)
    assert len(out.sequences) == 3
    for s in out.sequences:  # each sample has its own grammar state
        assert re.fullmatch(REGEX, s.text), s.text
        assert s.finish_reason == "stop"
    assert isinstance(json.loads(out_obj.text), dict) and out_obj.finish_reason == "stop"


def test_a_choice_is_one_of_its_strings(default_model, local_engine):
    """vLLM's `choice`: sampled answers are each exactly one of the strings (a grammar)."""
    choices = ["Lyon", "Paris", "Nice", "Île-de-France"]
    spec = StructuredOutputSpec.choice(choices)
    assert spec.kind == "grammar"
    config = kt.GenerationConfig(max_new_tokens=12, do_sample=True, seed=5, temperature=1.5,
                                 num_return_sequences=8, structured_output=spec)
    out = local_engine.generate_outputs(_chat(default_model, "Name a French city."), config,
                                        use_tqdm=False)[0]
    assert all(s.text in choices and s.finish_reason == "stop" for s in out.sequences)
    for bad in ([], ["a", ""], "Paris", [1]):
        with pytest.raises(ValueError, match="structured_output.choice"):
            StructuredOutputSpec.choice(bad)


@pytest.mark.parametrize("spec", [
    StructuredOutputSpec("json_schema", '{"type": "object", "properties": 5}'),
    StructuredOutputSpec("json_schema", "{not json"),
    StructuredOutputSpec("regex", "(unclosed"),
])
def test_invalid_spec_is_a_value_error_at_submit(local_engine, spec):
    with pytest.raises(ValueError, match="structured_output"):
        local_engine.submit(kt.Request("Hi", kt.GenerationConfig(structured_output=spec)))
    assert local_engine.generate("Hi", kt.GenerationConfig(max_new_tokens=2))


@pytest.mark.parametrize("do_sample", [False, True])
def test_grammar_wins_over_min_new_tokens_at_the_end_of_the_document(default_model, local_engine,
                                                                     do_sample):
    # After "yes"/"no" the grammar allows only the end of sequence, which min_new_tokens holds
    # back: every token is masked. The output must still end with the model's EOS, not with a
    # token the grammar refuses.
    regex = "(yes|no)"
    config = kt.GenerationConfig(max_new_tokens=20, min_new_tokens=10, do_sample=do_sample, seed=1,
                                 structured_output=StructuredOutputSpec("regex", regex))
    out = local_engine.generate_outputs([_chat(default_model, "Is Paris in France? Yes or no?")],
                                        [config], use_tqdm=False)[0]
    assert re.fullmatch(regex, out.text), out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] in default_model.eos_token_ids
    # One EOS, at the end, after the text's tokens (a sample may spell the text in several
    # tokens: "n", "o").
    *text_ids, _ = out.token_ids
    assert not set(text_ids) & set(default_model.eos_token_ids)
    assert default_model.tokenizer.decode(text_ids) == out.text
