"""Which JSON-schema keywords the grammar engine would silently ignore.

xgrammar compiles some keywords into no constraint at all (it may log a warning, nothing
more): a schema using them compiles, and the model's "stop" answer can then break it. vLLM's
xgrammar backend refuses such schemas; so do we, naming the keyword's place in the schema.
Found by feeding xgrammar 0.2.x an instance that breaks each keyword (tests/test_structured_
schema_support.py holds them to that).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Keywords that constrain nothing once compiled.
_IGNORED = ("uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
            "dependencies", "unevaluatedItems", "unevaluatedProperties")
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
    return None


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
