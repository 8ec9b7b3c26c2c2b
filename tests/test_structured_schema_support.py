"""JSON-schema keywords xgrammar compiles into no constraint are refused, naming their place
(vLLM's xgrammar backend refuses them too); the keywords it does enforce still compile."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from ksana_llm.generation_config import StructuredOutputSpec
from ksana_llm.structured import GrammarCompiler
from ksana_llm.structured.schema_support import unenforced_keyword

# (schema, an instance that breaks it, the path the refusal names)
UNENFORCED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "uniqueItems"),
    ({"type": "object", "properties": {"m": {"type": "integer", "multipleOf": 7, "minimum": 1}},
      "required": ["m"]}, '{"m": 2}', "properties.m.multipleOf"),
    ({"not": {"type": "integer"}}, "1", "not"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "1", "allOf"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "1", "if"),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "dependentRequired"),
    ({"type": "object", "properties": {"list": {"type": "array", "items": {
        "$ref": "#/$defs/n"}}}, "$defs": {"n": {"type": "array", "items": {"type": "integer"},
                                 "uniqueItems": True}}},
     '{"list": [[1, 1]]}', "$defs.n.uniqueItems"),
]


@pytest.mark.parametrize("schema, breaking, path", UNENFORCED)
def test_keywords_xgrammar_ignores_are_refused_by_path(schema, breaking, path):
    # The premise: xgrammar alone takes an instance the schema forbids.
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(breaking))
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, breaking)
    assert unenforced_keyword(schema) == path


ENFORCED = [
    {"type": "integer", "multipleOf": 7},
    {"allOf": [{"type": "integer"}]},
    {"type": "array", "contains": {"const": 5}},
    # property names that spell keywords are names, not keywords
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"},
                                      "uniqueItems": {"type": "boolean"}}},
    {"type": "object", "properties": {"x": {"enum": [{"not": 1}]}}},  # enum values are data
    True,
]


@pytest.mark.parametrize("schema", ENFORCED)
def test_enforced_keywords_pass(schema):
    assert unenforced_keyword(schema) is None


@pytest.fixture(scope="module")
def compiler(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return GrammarCompiler(tokenizer, len(tokenizer))


def test_the_compiler_refuses_them_with_the_path(compiler):
    schema, _, path = UNENFORCED[1]
    with pytest.raises(ValueError, match=rf"structured_output: the JSON schema's `{path}` is "
                                         r"not supported"):
        compiler.compile(StructuredOutputSpec("json_schema", json.dumps(schema)))
    compiler.compile(StructuredOutputSpec("json_schema", json.dumps(ENFORCED[0])))
