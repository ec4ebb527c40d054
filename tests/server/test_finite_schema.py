"""Schemas that admit no finite value are found before a grammar is compiled from them; schemas
that recurse but can stop are not."""

from __future__ import annotations

import pytest

from wafer.server.finite_schema import unbounded_part

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}

ENDLESS = {
    "required recursive $ref": ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#"),
    "through $defs": ({"$defs": {"n": NODE}, "$ref": "#/$defs/n"}, "#"),
    "bare $ref cycle": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#"),
    "itself": ({"$ref": "#"}, "#"),
    "array of at least one of itself": (
        {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
         "required": ["kids"]}, "#"),
    "tuple": ({"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2}, "#"),
    "allOf": ({"allOf": [{"$ref": "#/$defs/x"}], "$defs": {"x": {
        "type": "object", "properties": {"y": {"allOf": [{"$ref": "#"}]}}, "required": ["y"]}}}, "#"),
    "an optional key's bare cycle": (
        {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
         "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}, "#/$defs/a"),
}

FINITE = {
    "optional recursive key": {"type": "object", "properties": {"a": {"$ref": "#"}}},
    "tree of possibly no children": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    "nullable link": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                      "required": ["next"]},
    "object or null": {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "a definition nothing uses": {"type": "object", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "closed object": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                      "additionalProperties": False},
    "a long chain that ends": {"$defs": {**{f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}},
                                                      "required": ["n"]} for i in range(40)},
                                         "d40": {"type": "string"}}, "$ref": "#/$defs/d0"},
    "a reference outside the document": {"type": "object", "properties": {"a": {"$ref": "other.json#/x"}},
                                         "required": ["a"]},
}


@pytest.mark.parametrize("name", ENDLESS)
def test_a_schema_with_no_finite_value_is_found(name):
    schema, part = ENDLESS[name]
    assert unbounded_part(schema) == part


@pytest.mark.parametrize("name", FINITE)
def test_a_schema_that_can_stop_passes(name):
    assert unbounded_part(FINITE[name]) is None


def test_keywords_of_the_wrong_type_are_no_error():
    """The meta-schema check runs first, but what this reads of a keyword it checks itself."""
    odd = {"type": [{}, "object"], "required": 10, "properties": [], "minItems": "x", "items": 3, "anyOf": {},
           "$ref": 5, "allOf": [None], "prefixItems": {"a": 1}}
    assert unbounded_part(odd) is None
    assert unbounded_part({"type": "array", "minItems": 3, "items": [{"$ref": "#"}], "$ref": "#/x~"}) == "#"
