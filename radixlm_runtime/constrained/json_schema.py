"""JSON Schema → regular expression, plus the regexes behind `gen(..., dtype=...)`.

Whitespace policy: the generated JSON has no whitespace except what `separators` contains (default
`(",", ":")`, i.e. `json.dumps(value, separators=(",", ":"))`). One fixed layout keeps the automaton
small and makes `jump_forward` able to emit whole literal runs such as `{"name":"`. Object properties
come out in the schema's `properties` order; optional ones may be left out.

Unsupported or unsatisfiable schemas raise ValueError messages that start with `json_schema:` and
name the keyword.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

# The dtype regexes of SGLang's frontend (sglang/lang/ir.py) for int / float / bool, so programs
# written against `gen(dtype=...)` behave the same here.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
# SGLang uses "[\w\d\s]*" in quotes; a JSON string (with escapes) is what callers parsing the value expect.
STRING_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
REGEX_STR = f'"{STRING_CHAR}*"'

JSON_INTEGER = r"-?(0|[1-9][0-9]*)"
JSON_NUMBER = JSON_INTEGER + r"(\.[0-9]+)?([eE][+-]?[0-9]+)?"
JSON_BOOLEAN = "(true|false)"
JSON_NULL = "null"

_FORMATS = {
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "time": r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
_FORMATS["date-time"] = _FORMATS["date"] + "T" + _FORMATS["time"]

# Keywords that do not constrain the instance (or are handled where their parent is).
_ANNOTATIONS = {
    "title",
    "description",
    "examples",
    "default",
    "$schema",
    "$id",
    "$comment",
    "$defs",
    "definitions",
    "deprecated",
    "readOnly",
    "writeOnly",
}
_SUPPORTED = {
    "type",
    "enum",
    "const",
    "$ref",
    "anyOf",
    "oneOf",
    "allOf",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
}
_REGEX_META = set(".^$*+?{}[]\\|()/-")

_DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, str: REGEX_STR, bool: REGEX_BOOL}


def regex_for_dtype(dtype: type) -> str:
    """Regex for `gen(dtype=...)`: int, float, str or bool."""
    if dtype not in _DTYPE_REGEX:
        raise ValueError(f"dtype: expected one of int, float, str, bool, got {dtype!r}")
    return _DTYPE_REGEX[dtype]


def escape_literal(text: str) -> str:
    """Regex matching exactly `text`, using only escapes interegular understands."""
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _digits_same_length(lo: str, hi: str) -> str:
    """Regex for the decimal strings of equal length n between lo and hi (inclusive, lo <= hi)."""
    n = len(lo)
    if lo == "0" * n and hi == "9" * n:
        return f"[0-9]{{{n}}}" if n > 1 else "[0-9]"
    if n == 1:
        return lo if lo == hi else f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return lo[0] + _digits_same_length(lo[1:], hi[1:])
    parts = [lo[0] + _digits_same_length(lo[1:], "9" * (n - 1))]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}][0-9]{{{n - 1}}}")
    parts.append(hi[0] + _digits_same_length("0" * (n - 1), hi[1:]))
    return "(" + "|".join(parts) + ")"


def _natural_range(lo: int, hi: int | None) -> str:
    """Regex for the integers lo..hi (lo >= 0; hi None = unbounded) without leading zeros."""
    parts = []
    top = hi if hi is not None else 10 ** len(str(lo)) - 1
    for n in range(len(str(lo)), len(str(top)) + 1):
        sub_lo, sub_hi = max(lo, 10 ** (n - 1) if n > 1 else 0), min(top, 10**n - 1)
        if sub_lo <= sub_hi:
            parts.append(_digits_same_length(str(sub_lo), str(sub_hi)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return "(" + "|".join(parts) + ")"


def integer_range(lo: int | None, hi: int | None) -> str:
    """Regex for JSON integers in [lo, hi] (either bound may be None for unbounded)."""
    if lo is None and hi is None:
        return JSON_INTEGER
    parts = []
    if lo is None or lo < 0:  # negative part: -(max(1, -hi) .. -lo)
        neg_hi = None if lo is None else -lo
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        if neg_hi is None or neg_lo <= neg_hi:
            parts.append("-" + _natural_range(neg_lo, neg_hi))
    if hi is None or hi >= 0:
        parts.append(_natural_range(max(lo or 0, 0), hi))
    return "(" + "|".join(parts) + ")"


class _Converter:
    """One schema's conversion: holds the root (for $ref) and the refs currently being expanded."""

    def __init__(self, root: Any, separators: tuple[str, str], max_ref_depth: int, any_depth: int) -> None:
        self.root = root
        self.item_sep, self.key_sep = (escape_literal(s) for s in separators)
        self.separators = separators
        self.max_ref_depth = max_ref_depth
        self.any_depth = any_depth
        self.active_refs: Counter[str] = Counter()
        self.cut_ref: str | None = None

    def literal(self, value: Any) -> str:
        return escape_literal(json.dumps(value, separators=self.separators, ensure_ascii=False))

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise ValueError(
                f"json_schema: $ref {ref!r} is not supported (only refs within the schema, '#/...')"
            )
        node = self.root
        for raw in ref[1:].split("/")[1:]:
            key = raw.replace("~1", "/").replace("~0", "~")
            try:
                node = node[int(key)] if isinstance(node, list) else node[key]
            except (KeyError, IndexError, ValueError, TypeError):
                raise ValueError(f"json_schema: $ref {ref!r} does not resolve") from None
        return node

    def any_value(self, depth: int) -> str:
        """Any JSON value nested at most `depth` containers deep (a free-form value must be bounded)."""
        scalars = f"({REGEX_STR}|{JSON_NUMBER}|{JSON_BOOLEAN}|{JSON_NULL})"
        if depth == 0:
            return scalars
        inner = self.any_value(depth - 1)
        array = rf"\[({inner}({self.item_sep}{inner})*)?\]"
        member = f"{REGEX_STR}{self.key_sep}{inner}"
        obj = rf"\{{({member}({self.item_sep}{member})*)?\}}"
        return f"({scalars}|{array}|{obj})"

    def convert(self, schema: Any) -> str | None:
        """Regex for `schema`, or None when only a recursion cut-off makes it unsatisfiable."""
        if schema is True or schema == {}:
            return self.any_value(self.any_depth)
        if schema is False:
            raise ValueError("json_schema: the schema `false` matches nothing")
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema: expected a schema object, got {type(schema).__name__}")
        unknown = sorted(set(schema) - _SUPPORTED - _ANNOTATIONS)
        if unknown:
            raise ValueError(f"json_schema: unsupported keyword {unknown[0]!r}")
        if "$ref" in schema:
            return self.convert_ref(schema)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or len(set(schema) - _ANNOTATIONS) != 1:
                raise ValueError(
                    "json_schema: allOf is only supported with a single subschema and no siblings"
                )
            return self.convert(parts[0])
        if "enum" in schema or "const" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError("json_schema: enum must be a non-empty list (an empty enum matches nothing)")
            return "(" + "|".join(self.literal(v) for v in values) + ")"
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                options = schema[keyword]
                if not isinstance(options, list) or not options:
                    raise ValueError(f"json_schema: {keyword} must be a non-empty list")
                # oneOf is treated as anyOf: exclusivity cannot be expressed as a regex union.
                alternatives = [r for r in (self.convert(o) for o in options) if r is not None]
                return "(" + "|".join(alternatives) + ")" if alternatives else None
        types = schema.get("type")
        if types is None:
            types = "object" if "properties" in schema else "array" if "items" in schema else None
        if types is None:
            return self.any_value(self.any_depth)
        if isinstance(types, list):
            if not types:
                raise ValueError("json_schema: type must not be an empty list")
            alternatives = [r for r in (self.convert_type(t, schema) for t in types) if r is not None]
            return "(" + "|".join(alternatives) + ")" if alternatives else None
        return self.convert_type(types, schema)

    def convert_ref(self, schema: dict[str, Any]) -> str | None:
        ref = schema["$ref"]
        if set(schema) - _ANNOTATIONS - {"$ref"}:
            raise ValueError(f"json_schema: keywords next to $ref {ref!r} are not supported")
        if self.active_refs[ref] >= self.max_ref_depth:
            self.cut_ref = ref
            return None
        self.active_refs[ref] += 1
        try:
            return self.convert(self.resolve(ref))
        finally:
            self.active_refs[ref] -= 1

    def convert_type(self, kind: Any, schema: dict[str, Any]) -> str | None:
        if kind == "string":
            return self.string(schema)
        if kind == "integer":
            return self.integer(schema)
        if kind == "number":
            if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
                raise ValueError("json_schema: minimum/maximum are only supported for integers")
            return JSON_NUMBER
        if kind == "boolean":
            return JSON_BOOLEAN
        if kind == "null":
            return JSON_NULL
        if kind == "array":
            return self.array(schema)
        if kind == "object":
            return self.object(schema)
        raise ValueError(f"json_schema: unsupported type {kind!r}")

    def string(self, schema: dict[str, Any]) -> str:
        min_len, max_len = schema.get("minLength", 0), schema.get("maxLength")
        if max_len is not None and min_len > max_len:
            raise ValueError(f"json_schema: minLength {min_len} > maxLength {max_len} (unsatisfiable)")
        if "pattern" in schema:
            if "minLength" in schema or "maxLength" in schema:
                raise ValueError("json_schema: pattern together with minLength/maxLength is not supported")
            body = schema["pattern"]
            # JSON Schema patterns search; anchors make them full matches, otherwise any text may surround.
            at_start = body.startswith("^")
            at_end = body.endswith("$") and not body.endswith("\\$")
            body = body[1 if at_start else 0 : -1 if at_end else None]
            pad = f"{STRING_CHAR}*"
            return f'"{"" if at_start else pad}({body}){"" if at_end else pad}"'
        if schema.get("format") in _FORMATS:
            return f'"{_FORMATS[schema["format"]]}"'
        if min_len == 0 and max_len is None:
            return REGEX_STR
        upper = "" if max_len is None else str(max_len)
        return f'"{STRING_CHAR}{{{min_len},{upper}}}"'

    def integer(self, schema: dict[str, Any]) -> str:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            lo = schema["exclusiveMinimum"] + 1 if lo is None else max(lo, schema["exclusiveMinimum"] + 1)
        if "exclusiveMaximum" in schema:
            hi = schema["exclusiveMaximum"] - 1 if hi is None else min(hi, schema["exclusiveMaximum"] - 1)
        lo = None if lo is None else int(-(-lo // 1))  # fractional bounds round inwards
        hi = None if hi is None else int(hi // 1)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"json_schema: minimum {lo} > maximum {hi} (unsatisfiable)")
        return integer_range(lo, hi)

    def array(self, schema: dict[str, Any]) -> str | None:
        min_items, max_items = schema.get("minItems", 0), schema.get("maxItems")
        if max_items is not None and min_items > max_items:
            raise ValueError(f"json_schema: minItems {min_items} > maxItems {max_items} (unsatisfiable)")
        if max_items == 0:
            return r"\[\]"
        item = (
            self.convert(schema["items"]) if "items" in schema else self.any_value(max(self.any_depth - 1, 0))
        )
        if item is None:
            return r"\[\]" if min_items == 0 else None
        upper = "" if max_items is None else str(max_items - 1)
        body = f"{item}({self.item_sep}{item}){{{max(min_items - 1, 0)},{upper}}}"
        return rf"\[({body}){'?' if min_items == 0 else ''}\]"

    def object(self, schema: dict[str, Any]) -> str | None:
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        missing = sorted(required - set(properties))
        if missing:
            raise ValueError(f"json_schema: required property {missing[0]!r} is not listed in properties")
        extra = schema.get("additionalProperties")
        if not properties and isinstance(extra, dict):
            value = self.convert(extra)
            if value is None:
                return r"\{\}"
            member = f"{REGEX_STR}{self.key_sep}{value}"
            return rf"\{{({member}({self.item_sep}{member})*)?\}}"
        if not properties and extra is not False and "properties" not in schema:
            return self.any_object()
        members: list[tuple[str, bool]] = []
        for name, sub in properties.items():
            value = self.convert(sub)
            if value is None:
                if name in required:
                    return None
                continue
            members.append((f"{self.literal(name)}{self.key_sep}{value}", name in required))
        return rf"\{{{self.members(members)}\}}"

    def any_object(self) -> str:
        inner = self.any_value(max(self.any_depth - 1, 0))
        member = f"{REGEX_STR}{self.key_sep}{inner}"
        return rf"\{{({member}({self.item_sep}{member})*)?\}}"

    def members(self, members: list[tuple[str, bool]]) -> str:
        """Properties in order, optional ones skippable, with separators only between present ones.

        `rest(i, first)` is the text for members[i:], `first` meaning nothing was emitted yet. Once
        something was emitted each later member is just `(,m)?` or `,m`, so the regex stays O(n^2)."""

        def after_first(i: int) -> str:
            return "".join(
                f"{self.item_sep}{m}" if req else f"({self.item_sep}{m})?" for m, req in members[i:]
            )

        def from_start(i: int) -> str:
            if i == len(members):
                return ""
            member, req = members[i]
            if req:
                return member + after_first(i + 1)
            rest = from_start(i + 1)
            return f"({member}{after_first(i + 1)}{'|' + rest if rest else ''})" + ("" if rest else "?")

        return from_start(0)


def build_regex_from_schema(
    schema: str | dict[str, Any] | bool,
    separators: tuple[str, str] = (",", ":"),
    max_ref_depth: int = 3,
    any_depth: int = 2,
) -> str:
    """Regex whose full matches are JSON documents valid under `schema`, laid out with `separators`.

    Recursive `$ref`s are unrolled up to `max_ref_depth` levels; past that a branch is dropped (an
    optional property, an anyOf option, array items), and a schema that needs the cut branch is
    rejected. Free-form values (`{}`, objects without properties) nest at most `any_depth` deep."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"json_schema: not valid JSON: {e}") from None
    converter = _Converter(schema, separators, max_ref_depth, any_depth)
    regex = converter.convert(schema)
    if regex is None:
        raise ValueError(
            f"json_schema: recursive $ref {converter.cut_ref!r} cannot be bounded"
            f" within {max_ref_depth} levels"
        )
    return regex
