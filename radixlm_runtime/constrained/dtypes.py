"""The regexes behind the language's `gen(dtype=...)`, as SGLang's frontend defines them
(sglang/lang/ir.py), so programs written against it behave the same here."""

from __future__ import annotations

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
# SGLang uses "[\w\d\s]*" in quotes; a JSON string (with escapes) is what callers parsing the value expect.
REGEX_STR = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'

_DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, str: REGEX_STR, bool: REGEX_BOOL}


def regex_for_dtype(dtype: type) -> str:
    """Regex for `gen(dtype=...)`: int, float, str or bool."""
    if dtype not in _DTYPE_REGEX:
        raise ValueError(f"dtype: expected one of int, float, str, bool, got {dtype!r}")
    return _DTYPE_REGEX[dtype]
