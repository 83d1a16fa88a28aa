"""What a request constrains its output to, checked the same way whatever grammar backend runs it.

A constraint is one of SGLang's three kinds: `regex`, `json_schema` or `ebnf` (GBNF as xgrammar
parses it: `root ::= ...`). The grammar libraries silently ignore JSON-schema keywords they do not
implement, so schemas are checked here against the keywords both backends enforce: an unknown one is
refused naming the keyword, never dropped.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

ConstraintKind = Literal["regex", "json_schema", "ebnf"]
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = ("regex", "json_schema", "ebnf")

# JSON output layout: no whitespace but these separators, as `json.dumps(v, separators=(",", ":"))`.
# One layout keeps the model from wandering into whitespace and lets jump-forward append whole runs
# such as `{"name":"`.
JSON_SEPARATORS = (",", ":")

# Keywords that constrain the output and that both backends enforce.
_CONSTRAINING = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "format",
    }
)
# Annotations: they describe the value but never restrict it, so ignoring them is exact.
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
# String formats both backends implement.
SUPPORTED_FORMATS = frozenset(
    {"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
)
# Keywords whose value maps names to subschemas, and those holding a subschema or a list of them.
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")
# Deepest nesting of objects and arrays a JSON value may have: a request body (the body itself is
# level 1, server/http_utils.py) or a JSON schema. The JSON decoder, schema validation and the grammar
# compilers all recurse on nesting, and a few hundred levels exhaust Python's stack: deeper is refused.
MAX_JSON_DEPTH = 64
_CONTAINERS = (dict, list)


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: its kind (also the request field that carried it) and its text."""

    kind: ConstraintKind
    text: str

    @classmethod
    def of(cls, regex: str | None, json_schema: str | None, ebnf: str | None) -> Constraint | None:
        """The constraint among a request's fields (at most one may be set); None when unconstrained."""
        given = [(k, v) for k, v in zip(CONSTRAINT_KINDS, (regex, json_schema, ebnf)) if v is not None]
        if len(given) > 1:
            kinds = [k for k, _ in given]
            raise ValueError(f"only one of regex, json_schema and ebnf may be set, got {kinds}")
        return cls(*given[0]) if given else None

    def error(self, message: str) -> ValueError:
        """A ValueError whose message starts with the field, as the HTTP layer reports it."""
        return ValueError(message if message.startswith(self.kind) else f"{self.kind}: {message}")


class SchemaTooDeep(ValueError):
    """A schema nested past MAX_JSON_DEPTH (the HTTP layers answer it with code json_too_deep)."""

    def __init__(self) -> None:
        super().__init__(
            f"json_schema: JSON nested deeper than the limit of {MAX_JSON_DEPTH} levels of objects and arrays"
        )


def parse_schema(text: str) -> dict[str, Any] | bool:
    """The schema, refused (ValueError naming json_schema and the keyword) when it is not valid JSON,
    nested past MAX_JSON_DEPTH, not a valid JSON Schema, or uses a keyword the backends would not
    enforce. The depth is checked right after decoding, before anything recurses on the schema."""
    try:
        schema = json.loads(text)
    except RecursionError:  # the decoder's own bound, far past MAX_JSON_DEPTH
        raise SchemaTooDeep() from None
    except ValueError as e:
        raise ValueError(f"json_schema: not valid JSON: {e}") from None
    if nesting_exceeds(schema, MAX_JSON_DEPTH):
        raise SchemaTooDeep()
    if not isinstance(schema, (dict, bool)):
        raise ValueError("json_schema: must be a JSON object")
    if schema is False:
        raise ValueError("json_schema: the schema false admits no value")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"json_schema: not a valid JSON Schema: {e.message}") from None
    _check_keywords(schema)
    _check_finite(schema)
    return schema


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels deep in a decoded JSON value;
    walked level by level, without recursion."""
    level = [value] if isinstance(value, _CONTAINERS) else []
    for _ in range(limit):
        level = [c for v in level for c in _children(v) if isinstance(c, _CONTAINERS)]
        if not level:
            return False
    return bool(level)


def _children(value: dict[str, Any] | list[Any]) -> Any:
    return value.values() if isinstance(value, dict) else value


def subschemas(schema: Any, path: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object-valued (sub)schema with its JSON pointer, the root first."""
    if not isinstance(schema, dict):
        return  # a boolean schema, or a list the metaschema already checked
    yield path, schema
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from subschemas(sub, f"{path}/{key}/{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from subschemas(sub, f"{path}/{key}/{i}")
        elif key in _SCHEMA_VALUES:
            yield from subschemas(value, f"{path}/{key}")


def _check_keywords(schema: Any) -> None:
    for path, sub in subschemas(schema):
        for key, value in sub.items():
            if key not in _CONSTRAINING and key not in _ANNOTATIONS and not key.startswith("x-"):
                raise ValueError(f"json_schema: unsupported keyword {key!r} at {path}")
            if key == "format" and value not in SUPPORTED_FORMATS:
                supported = sorted(SUPPORTED_FORMATS)
                raise ValueError(
                    f"json_schema: unsupported format {value!r} at {path}; supported: {supported}"
                )


def _check_finite(schema: dict[str, Any] | bool) -> None:
    """Refuses a schema that only an infinitely nested value satisfies (a required property or item
    that refers back to its own schema on every branch): the grammar engines would loop or give up
    mid-generation instead of refusing it."""
    nodes = dict(subschemas(schema))
    known = {id(sub) for sub in nodes.values()}
    finite: set[int] = set()  # ids of the subschemas found to admit a finite value
    grew = True
    while grew:  # least fixpoint: a $ref counts as finite once its target was found finite
        grew = False
        for sub in nodes.values():
            if id(sub) not in finite and _admits_finite(sub, schema, known, finite):
                finite.add(id(sub))
                grew = True
    if id(schema) not in finite and isinstance(schema, dict):
        path = next((p for p, sub in nodes.items() if p != "#" and id(sub) not in finite), "#")
        raise ValueError(
            f"json_schema: no finite value satisfies it: a value of {path} must contain another one "
            "without end (a required property or item that refers back to its own schema)"
        )


def _admits_finite(sub: Any, root: Any, known: set[int], finite: set[int]) -> bool:
    """Whether some finite value satisfies sub, given which of the `known` subschemas are already
    found finite (the targets of its $refs are looked up there; a target elsewhere counts as finite:
    the check only refuses what surely nests without end)."""
    if isinstance(sub, bool):
        return sub
    if not isinstance(sub, dict):
        return True
    ref = sub.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = _resolve(root, ref)
        if target is False or isinstance(target, dict) and id(target) in known and id(target) not in finite:
            return False
    if not all(_admits_finite(s, root, known, finite) for s in sub.get("allOf", [])):
        return False
    for key in ("anyOf", "oneOf"):
        if key in sub and not any(_admits_finite(s, root, known, finite) for s in sub[key]):
            return False
    if "const" in sub or "enum" in sub:
        return True
    types = sub.get("type", ["null"])  # no type: null satisfies the object and array keywords
    types = [types] if isinstance(types, str) else types
    return any(_finite_of_type(t, sub, root, known, finite) for t in types)


def _finite_of_type(kind: str, sub: dict[str, Any], root: Any, known: set[int], finite: set[int]) -> bool:
    if kind == "object":
        props = sub.get("properties", {})
        extra = sub.get("additionalProperties", True)
        return all(
            _admits_finite(props.get(name, extra), root, known, finite) for name in sub.get("required", [])
        )
    if kind == "array":
        need = sub.get("minItems", 0)
        prefix = sub.get("prefixItems", [])
        rest = sub.get("items", True)
        return all(
            _admits_finite(prefix[i] if i < len(prefix) else rest, root, known, finite)
            for i in range(min(need, len(prefix) + 1))
        )
    return True


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local $ref points at; None when it does not resolve (the engine reports it)."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def closed_objects(schema: dict[str, Any] | bool) -> dict[str, Any] | bool:
    """A copy in which objects with `properties` but no `additionalProperties` admit no other keys,
    as OpenAI's strict mode and SGLang's default (xgrammar's strict_mode) read them: a model should
    not invent keys the schema does not name."""
    schema = copy.deepcopy(schema)
    for _, sub in subschemas(schema):
        if "properties" in sub and "additionalProperties" not in sub:
            sub["additionalProperties"] = False
    return schema
