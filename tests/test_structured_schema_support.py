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
from ksana_llm.structured.schema_support import unenforced_keyword, with_required_properties

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
    ({"type": "array", "contains": {"type": "integer"}}, "[]", "contains"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "minContains": 2},
     "[2, 3]", "contains"),
    # every constraint beside anyOf / oneOf / $ref is dropped; beside enum / const, but the values
    ({"anyOf": [{"type": "integer", "minimum": 5, "maximum": 9}], "maximum": 3}, "9",
     "maximum (beside anyOf)"),
    ({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]}, '"s"',
     "type (beside anyOf)"),
    ({"$defs": {"small": {"enum": [1, 2]}}, "$ref": "#/$defs/small", "minimum": 3}, "1",
     "minimum (beside $ref)"),
    ({"const": 3, "minimum": 5}, "3", "minimum (beside const)"),
    ({"type": "string", "enum": ["yes", "no"], "maxLength": 1}, '"no"',
     "maxLength (beside enum)"),
    ({"type": "integer", "enum": [1, "x"]}, '"x"', "type (beside enum)"),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}]}, "{}", "type (beside anyOf)"),
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
    # beside enum / const / anyOf / $ref: words, a `type` every value has, the $ref's maps
    {"type": "string", "enum": ["a", "b"], "description": "d"},
    {"type": ["string", "integer"], "enum": ["a", 1]},
    {"type": "integer", "const": 2.0},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "X"},
    {"$ref": "#/$defs/s", "description": "d", "$defs": {"s": {"type": "string"}}},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}}}],
     "discriminator": {"propertyName": "kind"}},
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


def _accepts(compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text) and matcher.is_completed())


@pytest.mark.parametrize("schema, valid, invalid", [
    ({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name", "email"]},
     '{"name": "a", "email": "b"}', '{"name": "a"}'),
    ({"type": "object", "required": ["id"]}, '{"id": 1}', "{}"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "required": ["n"]},
     '{"n": 1}', "{}"),
])
def test_a_required_name_properties_lack_is_made_not_banned(compiler, schema, valid, invalid):
    """xgrammar alone compiles such a name as a key the object may not have (so the answer
    could never hold it, or beside `additionalProperties` as optional); its schema is then
    `additionalProperties`' (anything by default)."""
    alone = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert not _is_grammar_accept_string(alone, valid) or _is_grammar_accept_string(alone, invalid)
    compiled = compiler.compile(StructuredOutputSpec("json_schema", json.dumps(schema)))
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(json.loads(valid)) and _accepts(compiled, valid)
    assert not validator.is_valid(json.loads(invalid)) and not _accepts(compiled, invalid)


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
      "additionalProperties": False},
     r"`required` names 'b', which `properties` lacks and `additionalProperties: false` "
     r"forbids: no object satisfies it"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/point.json"}}},
     r"`properties\.a\.\$ref` is not supported"),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "required": ["x1"]},
     r"`required` is not supported"),
    ({"type": "object", "properties": {"pw": {"type": "string",
                                              "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}}},
     r"`properties\.pw\.pattern` is not supported: .*Lookahead"),
])
def test_schemas_the_grammar_would_misread_are_refused(compiler, schema, message):
    with pytest.raises(ValueError, match=rf"structured_output: the JSON schema's {message}"):
        compiler.compile(StructuredOutputSpec("json_schema", json.dumps(schema)))


def test_the_completed_schema_is_a_copy():
    schema = {"type": "object", "properties": {"a": {"type": "object", "required": ["b"]}}}
    before = json.dumps(schema)
    completed = with_required_properties(schema)
    assert json.dumps(schema) == before
    assert completed["properties"]["a"]["properties"] == {"b": {}}
    assert with_required_properties({"type": "integer"}) == {"type": "integer"}
