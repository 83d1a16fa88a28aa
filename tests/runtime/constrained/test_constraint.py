"""Constraints before any backend: one kind per request, and JSON schemas refused (naming the
keyword and where it is) when a backend would silently not enforce them."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from radixlm_runtime.constrained.constraint import Constraint, closed_objects, parse_schema


class Address(BaseModel):
    city: str = Field(min_length=1, max_length=40, description="where")
    zip: str | None = Field(default=None, pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str
    kind: Literal["a", "b"]
    addresses: list[Address] = Field(min_length=1, max_length=3)
    score: float = Field(ge=0, lt=10)


def test_one_kind_per_request() -> None:
    assert Constraint.of(None, None, None) is None
    assert Constraint.of("a+", None, None) == Constraint("regex", "a+")
    assert Constraint.of(None, None, "root ::= x") == Constraint("ebnf", "root ::= x")
    with pytest.raises(
        ValueError, match=r"only one of regex, json_schema and ebnf may be set, got \['regex', 'ebnf'\]"
    ):
        Constraint.of("a", None, "root ::= x")
    assert str(Constraint("regex", "(").error("bad")) == "regex: bad"


def test_pydantic_and_openai_strict_schemas_pass() -> None:
    schema = Person.model_json_schema()
    assert "$defs" in schema and parse_schema(json.dumps(schema)) == schema
    strict = {
        "type": "object",
        "properties": {
            "a": {"type": ["string", "null"]},
            "b": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    assert parse_schema(json.dumps(strict)) == strict


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ("{not json", "json_schema: not valid JSON"),
        ("[1]", "json_schema: must be a JSON object"),
        ("false", "json_schema: the schema false admits no value"),
        ({"type": 12}, "json_schema: not a valid JSON Schema"),
        ({"type": "array", "uniqueItems": True}, "json_schema: unsupported keyword 'uniqueItems' at #"),
        (
            {"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}},
            "json_schema: unsupported keyword 'multipleOf' at #/properties/a",
        ),
        ({"$defs": {"n": {"not": {"type": "null"}}}}, "json_schema: unsupported keyword 'not' at #/$defs/n"),
        ({"anyOf": [{"type": "object", "patternProperties": {}}]}, "'patternProperties' at #/anyOf/0"),
        ({"type": "array", "items": {"if": {}}}, "'if' at #/items"),
        ({"type": "string", "format": "iri"}, "json_schema: unsupported format 'iri' at #"),
        ({"type": "string", "nullable": True}, "unsupported keyword 'nullable'"),
    ],
)
def test_refused_schemas_name_the_keyword(schema: Any, message: str) -> None:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    with pytest.raises(ValueError, match=message.replace("$", r"\$").replace("[", r"\[")):
        parse_schema(text)


def test_annotations_and_extensions_are_accepted() -> None:
    schema = {
        "title": "t",
        "description": "d",
        "default": 1,
        "examples": [1],
        "x-vendor": {},
        "type": "integer",
    }
    assert parse_schema(json.dumps(schema)) == schema


def test_closed_objects_only_where_unset() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {}},
            "b": {"type": "object", "properties": {}, "additionalProperties": True},
        },
    }
    closed = closed_objects(schema)
    assert (
        closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    )
    assert closed["properties"]["b"]["additionalProperties"] is True
    assert "additionalProperties" not in schema, "the caller's schema is left alone"


NODE = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"n": NODE | {"required": ["c"]}}, "$ref": "#/$defs/n"},
        {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        {
            "$defs": {"n": {"anyOf": [{"$ref": "#/$defs/m"}]}, "m": {"allOf": [{"$ref": "#/$defs/n"}]}},
            "$ref": "#/$defs/n",
        },
    ],
    ids=["required-property", "root", "non-empty-array", "ref-cycle"],
)
def test_schema_only_an_endless_value_satisfies_is_refused(schema: dict) -> None:
    with pytest.raises(ValueError, match="^json_schema: no finite value satisfies it"):
        parse_schema(json.dumps(schema))


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"n": NODE}, "$ref": "#/$defs/n"},
        {"type": "array", "items": {"$ref": "#"}},
        {"$defs": {"n": {"anyOf": [{"type": "integer"}, NODE | {"required": ["c"]}]}}, "$ref": "#/$defs/n"},
    ],
    ids=["optional-property", "empty-array", "a-finite-branch"],
)
def test_recursive_schema_with_a_finite_value_is_accepted(schema: dict) -> None:
    assert parse_schema(json.dumps(schema)) == schema
