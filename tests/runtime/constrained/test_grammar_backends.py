"""Both grammar backends on the real SmolLM2 vocabulary: sampled walks match their constraint,
known documents are accepted or refused as JSON Schema / the grammar says, EOS only where the output
is complete, rollback returns to earlier states, and refused constraints name their field."""

from __future__ import annotations

import json
import random
import re
from typing import Any, Literal

import jsonschema
import numpy as np
import pytest
from constrained_helpers import allowed_ids, random_walk
from pydantic import BaseModel, Field

from radixlm_runtime.constrained.backend import GrammarBackend, check_constraint
from radixlm_runtime.constrained.constraint import Constraint

VOCAB = 49152
IP = r"(25[0-5]|2[0-4]\d|1?\d?\d)(\.(25[0-5]|2[0-4]\d|1?\d?\d)){3}"
ARITHMETIC = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog"]


class Person(BaseModel):
    """A pydantic model as clients send it: $defs/$ref, anyOf with null, enum, bounds."""

    age: int = Field(ge=0, le=150)
    pet: Pet | None
    tags: list[Literal["a", "b"]] = Field(max_length=2)


PERSON = Person.model_json_schema()
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["v", "kids"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def guide_for(backend: GrammarBackend, kind: str, text: str) -> Any:
    return backend.guide(backend.compile(Constraint(kind, text)))  # type: ignore[arg-type]


def accepts(backend: GrammarBackend, tokenizer: Any, kind: str, text: str, document: str) -> bool:
    """Whether `document` (canonically tokenized) is a complete match of the constraint."""
    guide = guide_for(backend, kind, text)
    return guide.advance_tokens(encode(tokenizer, document)) and guide.is_accepting()


@pytest.mark.parametrize("pattern", [IP, "(yes|no)", "[a-z]{3,8}", "h\u00e9llo \u65e5\u672c{1,2}!"])
def test_regex_walks_fullmatch(
    backend: GrammarBackend, smol_tokenizer: Any, smol_eos: int, pattern: str
) -> None:
    compiled = backend.compile(Constraint("regex", pattern))
    rng = random.Random(0)
    for _ in range(8):
        ids = random_walk(backend.guide(compiled), VOCAB, smol_eos, rng)
        assert ids is not None
        assert re.fullmatch(pattern, smol_tokenizer.decode(ids)), smol_tokenizer.decode(ids)


def test_multibyte_character_split_across_tokens(backend: GrammarBackend, smol_tokenizer: Any) -> None:
    """Tokens that each hold part of a character's UTF-8 bytes are followed byte by byte."""
    text = "\u65e5\u672c\u8a9e"
    ids = encode(smol_tokenizer, text)
    assert any("\ufffd" in smol_tokenizer.decode([i]) for i in ids), "the tokenizer splits these characters"
    assert accepts(backend, smol_tokenizer, "regex", text, text)
    assert not accepts(backend, smol_tokenizer, "regex", text, "\u65e5\u672c\u8a9a")


def test_schema_walks_validate(backend: GrammarBackend, smol_tokenizer: Any, smol_eos: int) -> None:
    compiled = backend.compile(Constraint("json_schema", json.dumps(PERSON)))
    rng = random.Random(1)
    done = 0
    for _ in range(6):
        ids = random_walk(backend.guide(compiled), VOCAB, smol_eos, rng, budget=80)
        if ids is not None:
            done += 1
            jsonschema.validate(json.loads(smol_tokenizer.decode(ids)), PERSON)
    assert done > 0


DOCUMENTS = [
    ({"type": "integer", "minimum": 0, "maximum": 150}, ["0", "150", "42"], ["151", "-1", "4.5"]),
    ({"type": "number", "exclusiveMinimum": 0}, ["0.5", "3"], ["0", "-2"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"', '"abc"'], ['"a"', '"abcd"']),
    ({"enum": ["red", 1, None]}, ['"red"', "1", "null"], ['"blue"', "2"]),
    ({"const": {"a": 1}}, ['{"a":1}'], ['{"a":2}']),
    ({"type": ["string", "null"]}, ['"x"', "null"], ["1"]),
    (
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
        ["[1]", "[1,2]"],
        ["[]", "[1,2,3]"],
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        },
        ['{"a":1}'],
        ['{"a":1,"b":2}', "{}"],
    ),
    ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, ["3", "true"], ['"3"']),
    (
        PERSON,
        ['{"age":3,"pet":{"name":"Rex","kind":"dog"},"tags":["a"]}', '{"age":3,"pet":null,"tags":[]}'],
        ['{"age":3,"pet":{"name":"Rex","kind":"cow"},"tags":[]}'],
    ),
    (
        TREE,
        [
            json.dumps(
                {
                    "v": 1,
                    "kids": [
                        {"v": 2, "kids": [{"v": 3, "kids": [{"v": 4, "kids": [{"v": 5, "kids": []}]}]}]}
                    ],
                },
                separators=(",", ":"),
            )
        ],
        ['{"v":1,"kids":[{"v":2}]}'],
    ),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), DOCUMENTS)
def test_schema_documents(
    backend: GrammarBackend, smol_tokenizer: Any, schema: dict, valid: list[str], invalid: list[str]
) -> None:
    text = json.dumps(schema)
    for doc in valid:
        jsonschema.validate(json.loads(doc), schema)
        assert accepts(backend, smol_tokenizer, "json_schema", text, doc), doc
    for doc in invalid:
        assert not accepts(backend, smol_tokenizer, "json_schema", text, doc), doc


def test_pattern_with_length_bounds(backend: GrammarBackend, smol_tokenizer: Any) -> None:
    """llguidance enforces both; xgrammar would drop the bounds, so that backend refuses the schema."""
    text = json.dumps({"type": "string", "pattern": "^[a-z]+$", "minLength": 3})
    if type(backend).__module__.endswith("xgrammar_backend"):
        with pytest.raises(ValueError, match="pattern with minLength/maxLength at #"):
            backend.compile(Constraint("json_schema", text))
        return
    assert accepts(backend, smol_tokenizer, "json_schema", text, '"abc"')
    for doc in ['"ab"', '"abC"']:
        assert not accepts(backend, smol_tokenizer, "json_schema", text, doc), doc


def test_undeclared_keys_are_refused(backend: GrammarBackend, smol_tokenizer: Any) -> None:
    """Objects naming their properties admit no others unless additionalProperties says so."""
    closed = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    opened = json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    )
    assert not accepts(backend, smol_tokenizer, "json_schema", closed, '{"a":1,"b":2}')
    assert accepts(backend, smol_tokenizer, "json_schema", opened, '{"a":1,"b":2}')


def test_ebnf(backend: GrammarBackend, smol_tokenizer: Any, smol_eos: int) -> None:
    for doc in ["1", "12+(3-4)", "((7))"]:
        assert accepts(backend, smol_tokenizer, "ebnf", ARITHMETIC, doc), doc
    for doc in ["1+", "(1", "a", "1 + 2"]:
        assert not accepts(backend, smol_tokenizer, "ebnf", ARITHMETIC, doc), doc


def test_rollback_returns_to_earlier_states(backend: GrammarBackend, smol_tokenizer: Any) -> None:
    ids = encode(smol_tokenizer, '{"age":31,"pet":null,"tags":["a","b"]}')
    guide = guide_for(backend, "json_schema", json.dumps(PERSON))
    masks, accepting = [], []
    for token in ids:
        masks.append(guide.allowed_mask(VOCAB).copy())
        accepting.append(guide.is_accepting())
        guide.advance(token)
    assert guide.is_accepting()
    for back in (1, 3, len(ids)):
        guide.rollback(back)
        at = len(ids) - back
        assert np.array_equal(guide.allowed_mask(VOCAB), masks[at]) and guide.is_accepting() == accepting[at]
        assert guide.advance_tokens(ids[at:]) and guide.is_accepting()


def test_eos_only_where_complete_then_finished(
    backend: GrammarBackend, smol_tokenizer: Any, smol_eos: int
) -> None:
    guide = guide_for(backend, "regex", "(yes|no)!?")
    assert smol_eos not in allowed_ids(guide, VOCAB) and not guide.is_accepting()
    guide.advance_tokens(encode(smol_tokenizer, "yes"))
    assert smol_eos in allowed_ids(guide, VOCAB) and guide.is_accepting() and not guide.is_finished()
    guide.advance(smol_eos)
    assert guide.is_finished()
    done = guide_for(backend, "regex", "(yes|no)")
    done.advance_tokens(encode(smol_tokenizer, "no"))
    assert done.is_finished(), "a complete match nothing can extend ends the request (under ignore_eos too)"


def test_disallowed_tokens(backend: GrammarBackend, smol_tokenizer: Any) -> None:
    guide = guide_for(backend, "regex", "[0-9]+")
    before = guide.allowed_mask(VOCAB).copy()
    assert not guide.advance_tokens(encode(smol_tokenizer, "12a"))
    assert np.array_equal(guide.allowed_mask(VOCAB), before), "a refused advance_tokens changes nothing"
    with pytest.raises(ValueError, match="not allowed"):
        guide.advance(encode(smol_tokenizer, "x")[0])


def test_jump_forward_gives_forced_text(backend: GrammarBackend, smol_tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    guide = guide_for(backend, "json_schema", json.dumps(schema))
    forced = guide.jump_forward()
    assert forced is not None and forced.startswith("{") and '{"name":"'.startswith(forced)
    guide.advance_tokens(encode(smol_tokenizer, '{"name":"Al'))
    assert guide.jump_forward() is None


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("regex", "(a"), "regex"),
        (Constraint("ebnf", "root ::= missing"), "ebnf"),
        (Constraint("ebnf", "root ::= ("), "ebnf"),
        (
            Constraint("json_schema", '{"type": "array", "uniqueItems": true}'),
            "json_schema: unsupported keyword 'uniqueItems'",
        ),
        (Constraint("json_schema", "[1]"), "json_schema: must be a JSON object"),
    ],
)
def test_refused_constraints_name_their_field(
    backend: GrammarBackend, constraint: Constraint, message: str
) -> None:
    name = type(backend).__module__.rsplit(".", 1)[1].removesuffix("_backend")
    with pytest.raises(ValueError, match=re.escape(message)):
        check_constraint(name, constraint)
    with pytest.raises(ValueError, match=re.escape(message)):
        backend.compile(constraint)


def test_engine_failure_is_reported_not_a_stop(backend: GrammarBackend, smol_tokenizer: Any) -> None:
    """Opening an object of 1,000 optional properties exceeds llguidance's parser limit
    (ParserTooComplex): its guide says so instead of allowing only EOS as a complete output would.
    xgrammar compiles the object ahead of time and follows it."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    guide = backend.guide(backend.compile(Constraint("json_schema", json.dumps(wide))))
    assert guide.error() is None
    opened = guide.advance_tokens(smol_tokenizer.encode('{"', add_special_tokens=False))
    if type(backend).__module__.endswith("llguidance_backend"):
        assert not opened and "Current row has 3999 items" in (guide.error() or "")
        assert "\n" not in (guide.error() or "")
    else:
        assert opened and guide.error() is None
