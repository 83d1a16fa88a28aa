"""JSON Schema → regex: random walks through the token index give valid documents; compact
serialisations of valid documents match and invalid ones do not; bad schemas name the keyword."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
from constrained_helpers import random_walk

from radixlm_runtime.constrained.json_schema import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    build_regex_from_schema,
    integer_range,
    regex_for_dtype,
)
from radixlm_runtime.constrained.regex_fsm import TokenVocab, build_token_index

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "score", "active", "tags"],
}

# (schema, valid documents, invalid documents); every keyword the converter supports appears somewhere.
CASES: list[tuple[dict[str, Any], list[Any], list[Any]]] = [
    (
        PERSON,
        [{"name": "Bo", "age": 7, "email": "a@b.com", "score": -1.5e3, "active": True, "tags": ["x", ""]}],
        [
            {"name": "", "age": 7, "email": "a@b.com", "score": 1, "active": True, "tags": []},
            {"name": "Bo", "age": 131, "email": "a@b.com", "score": 1, "active": True, "tags": []},
            {"name": "Bo", "age": 7, "email": "a@b.org", "score": 1, "active": True, "tags": []},
        ],
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "null"}, "c": {"type": "boolean"}},
            "required": ["b"],
        },
        [{"b": None}, {"a": -3, "b": None}, {"b": None, "c": False}, {"a": 0, "b": None, "c": True}],
        [{}, {"a": 1}, {"b": 0}],
    ),
    (
        {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "string"}}},
        [{}, {"x": 0.5}, {"y": 'q"\\'}, {"x": 1e-7, "y": "\u00e9\n"}],
        [{"x": "1"}, {"y": 2}],
    ),
    (
        {"enum": ["red", "green", 3, None, [1, 2], {"k": "v"}]},
        ["red", 3, None, [1, 2], {"k": "v"}],
        ["blue", 4, [2, 1]],
    ),
    ({"const": {"version": 2, "ok": True}}, [{"version": 2, "ok": True}], [{"version": 3, "ok": True}]),
    (
        {"type": "array", "items": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3}},
        [[], [-2, 0, 2]],
        [[3], [-3], [1.5]],
    ),
    (
        {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 3},
        [["a", "b"], ["b", "b", "a"]],
        [["a"], ["a", "a", "a", "a"], ["c", "a"]],
    ),
    (
        {
            "type": "object",
            "properties": {
                "user": {"$ref": "#/$defs/user"},
                "friends": {"type": "array", "items": {"$ref": "#/definitions/id"}, "maxItems": 2},
            },
            "required": ["user"],
            "$defs": {
                "user": {
                    "type": "object",
                    "properties": {"id": {"$ref": "#/definitions/id"}, "admin": {"type": "boolean"}},
                    "required": ["id", "admin"],
                }
            },
            "definitions": {"id": {"type": "string", "format": "uuid"}},
        },
        [{"user": {"id": "123e4567-e89b-12d3-a456-426614174000", "admin": False}, "friends": []}],
        [{"user": {"id": "nope", "admin": False}}, {"user": {"admin": False}}],
    ),
    (
        {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}, {"type": "null"}]},
        ["abc", -12, None],
        ["abcd", 1.5, True],
    ),
    (
        {"oneOf": [{"type": "boolean"}, {"type": "string", "format": "date"}]},
        [True, "2024-02-29"],
        [None, "2024-13-01"],
    ),
    (
        {"type": ["integer", "null"], "minimum": 10},
        [10, 99999, None],
        [9, -1, "x"],
    ),
    (
        {"type": "object", "additionalProperties": {"type": "integer"}},
        [{}, {"a": 1, "b": 2}],
        [{"a": "1"}],
    ),
    (
        {"allOf": [{"type": "string", "format": "date-time"}], "title": "when"},
        ["2024-01-02T03:04:05Z", "2024-01-02T03:04:05.25+01:00"],
        ["2024-01-02 03:04:05", "2024-01-02T03:04:05"],
    ),
    (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/node",
        },
        [{"v": 1}, {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}],
        [{"kids": []}],
    ),
    ({}, [1, "s", None, [1, {"a": 2}], {"k": [True]}], []),  # free-form values nest at most 2 deep
]


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES)
def test_documents_match_exactly_when_valid(
    schema: dict[str, Any], valid: list[Any], invalid: list[Any]
) -> None:
    regex = build_regex_from_schema(schema)
    for doc in valid:
        jsonschema.validate(doc, schema)
        assert re.fullmatch(regex, _dump(doc)), doc
    for doc in invalid:
        assert re.fullmatch(regex, _dump(doc)) is None, doc


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES)
def test_random_walks_give_valid_documents(
    schema: dict[str, Any], valid: list[Any], invalid: list[Any], tiny_vocab: TokenVocab
) -> None:
    index = build_token_index(build_regex_from_schema(schema), tiny_vocab)
    rng = random.Random(0)
    for _ in range(20):
        text = "".join(tiny_vocab.texts[i] for i in random_walk(index, rng, budget=80))
        jsonschema.validate(json.loads(text), schema)


def test_schema_given_as_json_text_and_other_separators() -> None:
    regex = build_regex_from_schema(json.dumps(PERSON), separators=(", ", ": "))
    doc = {"name": "Al", "age": 1, "email": "a@b.com", "score": 2, "active": False, "tags": ["a", "b"]}
    assert re.fullmatch(regex, json.dumps(doc))
    assert not re.fullmatch(regex, _dump(doc))


def test_integer_ranges_are_exact() -> None:
    for lo, hi in [
        (0, None),
        (7, None),
        (-3, 7),
        (None, -5),
        (None, 10),
        (18, 120),
        (-120, -18),
        (0, 0),
        (9, 1234),
    ]:
        regex = integer_range(lo, hi)
        for n in range(-1300, 1300):
            expected = (lo is None or n >= lo) and (hi is None or n <= hi)
            assert bool(re.fullmatch(regex, str(n))) == expected, (lo, hi, n)


def test_dtype_regexes() -> None:
    assert regex_for_dtype(int) == REGEX_INT and re.fullmatch(REGEX_INT, "-42 ")
    assert regex_for_dtype(float) == REGEX_FLOAT and re.fullmatch(REGEX_FLOAT, "3.14")
    assert regex_for_dtype(bool) == REGEX_BOOL and re.fullmatch(REGEX_BOOL, "False")
    assert (
        regex_for_dtype(str) == REGEX_STR and json.loads(re.fullmatch(REGEX_STR, '"a\\"b"').group()) == 'a"b'
    )
    with pytest.raises(ValueError, match="dtype"):
        regex_for_dtype(list)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems 3 > maxItems 2"),
        ({"enum": []}, "enum must be a non-empty list"),
        ({"type": "string", "minLength": 5, "maxLength": 1}, "minLength 5 > maxLength 1"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum 5 > maximum 1"),
        ({"type": "array", "uniqueItems": True}, "unsupported keyword 'uniqueItems'"),
        ({"type": "object", "patternProperties": {"a": {}}}, "unsupported keyword 'patternProperties'"),
        ({"not": {"type": "string"}}, "unsupported keyword 'not'"),
        ({"type": "number", "minimum": 0}, "minimum/maximum are only supported for integers"),
        ({"type": "object", "required": ["a"]}, "required property 'a' is not listed"),
        ({"$ref": "other.json#/a"}, "only refs within the schema"),
        ({"$ref": "#/$defs/missing"}, "does not resolve"),
        ({"type": "date"}, "unsupported type 'date'"),
        (False, "matches nothing"),
        (
            {
                "$defs": {
                    "n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}
                },
                "$ref": "#/$defs/n",
            },
            "recursive $ref '#/$defs/n' cannot be bounded",
        ),
    ],
)
def test_bad_schemas(schema: Any, message: str) -> None:
    with pytest.raises(ValueError, match=r"^json_schema: .*" + re.escape(message)):
        build_regex_from_schema(schema)


def test_invalid_json_text() -> None:
    with pytest.raises(ValueError, match="^json_schema: not valid JSON"):
        build_regex_from_schema("{")
