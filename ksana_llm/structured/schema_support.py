"""Which JSON-schema keywords the grammar engine would silently ignore.

xgrammar compiles some keywords into no constraint at all (it may log a warning, nothing
more): a schema using them compiles, and the model's "stop" answer can then break it. vLLM's
xgrammar backend refuses such schemas; so do we, naming the keyword's place in the schema.
Found by feeding xgrammar 0.2.x an instance that breaks each keyword (tests/test_structured_
schema_support.py holds them to that). Besides keywords it ignores everywhere, it drops every
constraint beside `anyOf` / `oneOf` / `$ref` and keeps only the values beside `enum` / `const`,
follows no `$ref` outside the schema, and compiles a `required` name that `properties` lacks as a
ban on that key: `with_required_properties` lists such names as properties, so they are made.
`oneOf` is compiled as `anyOf` (an answer matching two branches passes; kept, as pydantic's
tagged unions are `oneOf`s of disjoint branches).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

# Keywords that constrain nothing once compiled.
_IGNORED = ("uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
            "dependencies", "unevaluatedItems", "unevaluatedProperties", "contains",
            "minContains", "maxContains")
# Keywords that constrain nothing by nature, and the schema maps a `$ref` points into: welcome
# beside the keywords whose siblings xgrammar drops.
_INERT = frozenset(("title", "description", "default", "examples", "$comment", "deprecated",
                    "readOnly", "writeOnly", "$id", "$schema", "$anchor", "discriminator",
                    "$defs", "definitions"))
# Keywords beside which xgrammar compiles nothing else (enum / const: but the values, and a
# `type` they all have is redundant).
_ALONE = ("enum", "const", "anyOf", "oneOf", "$ref")
# multipleOf holds alone, but is dropped beside a range.
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

# Where a schema holds subschemas: one, a list of them, or a name -> schema map.
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def unenforced_keyword(schema: Any) -> str | None:
    """The path (`properties.m.multipleOf`) of the first keyword in `schema` that xgrammar
    would not enforce, or None when every keyword holds."""
    for path, node in _subschemas(schema, ""):
        found = _unenforced_here(node)
        if found is not None:
            return f"{path}{found}"
    return None


def _unenforced_here(node: dict[str, Any]) -> str | None:
    for key in _IGNORED:
        if key in node:
            return key
    if "multipleOf" in node and any(key in node for key in _RANGE):
        return "multipleOf"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "allOf"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return "$ref"  # another document: xgrammar would take any value there
    if isinstance(node.get("required"), list) and "patternProperties" in node:
        return "required"  # a required name the patterns match may not be listed as a property
    alone = next((key for key in _ALONE if key in node), None)
    if alone is not None:
        for key in node:
            if key == alone or key in _INERT:
                continue
            if key == "type" and alone in ("enum", "const") and _values_have_type(node, alone):
                continue
            return f"{key} (beside {alone})"
    return None


def _values_have_type(node: dict[str, Any], values_key: str) -> bool:
    values = node[values_key] if values_key == "enum" else [node[values_key]]
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    if not isinstance(values, list):
        return False
    return all(any(_has_json_type(value, name) for name in types) for value in values)


def _has_json_type(value: Any, name: Any) -> bool:
    """Whether `value` (parsed JSON) is of JSON-schema type `name` (False for an unknown name)."""
    if not isinstance(name, str):
        return False
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "integer":
        return number and (isinstance(value, int) or value.is_integer())
    return {"string": isinstance(value, str), "number": number,
            "boolean": isinstance(value, bool), "null": value is None,
            "array": isinstance(value, list), "object": isinstance(value, dict)}.get(name, False)


def with_required_properties(schema: Any) -> Any:
    """`schema`, with every `required` name that its object's `properties` lacks listed there,
    its schema `additionalProperties`' (anything when that is absent or true), so that the
    grammar makes the key instead of banning it (xgrammar's reading of such a schema). Unchanged
    (the same object) when no name is missing; ValueError when `additionalProperties: false`
    makes the object impossible."""
    if not any(_missing_required(node) for _, node in _subschemas(schema, "")):
        return schema
    schema = copy.deepcopy(schema)
    for path, node in _subschemas(schema, ""):
        missing = _missing_required(node)
        if not missing:
            continue
        extra = node.get("additionalProperties", True)
        if extra is False:
            raise ValueError(f"structured_output: the JSON schema's `{path}required` names "
                             f"{missing[0]!r}, which `properties` lacks and "
                             "`additionalProperties: false` forbids: no object satisfies it")
        properties = node.setdefault("properties", {})
        for name in missing:
            properties[name] = extra if isinstance(extra, dict) else {}
    return schema


def _missing_required(node: dict[str, Any]) -> list[str]:
    required, properties = node.get("required"), node.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict):
        return []
    return [name for name in required if isinstance(name, str) and name not in properties]


def string_patterns(schema: Any) -> Iterator[tuple[str, str]]:
    """(path, regex) of every `pattern` in `schema`, for the caller to check that the regex
    engine takes it: xgrammar drops a lookahead it cannot compile, where its regex route
    refuses it."""
    for path, node in _subschemas(schema, ""):
        if isinstance(node.get("pattern"), str):
            yield f"{path}pattern", node["pattern"]


def _subschemas(schema: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in `schema` (itself first), with its path as a prefix ("a.b.")."""
    if not isinstance(schema, dict):
        return  # a boolean schema, or a malformed part xgrammar itself will refuse
    yield path, schema
    for key in _ONE:
        value = schema.get(key)
        if isinstance(value, list):  # draft-4 tuple `items`
            for i, item in enumerate(value):
                yield from _subschemas(item, f"{path}{key}.{i}.")
        else:
            yield from _subschemas(value, f"{path}{key}.")
    for key in _LIST:
        value = schema.get(key)
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from _subschemas(item, f"{path}{key}.{i}.")
    for key in _MAP:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, item in value.items():
                yield from _subschemas(item, f"{path}{key}.{name}.")
