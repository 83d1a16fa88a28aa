"""Constrained decoding: regex / JSON Schema → character DFA → token-level index → per-request guide.

Exports load lazily: the frontend language needs only the dtype regexes of json_schema, and an
HTTP-only program must not pay for importing what the compiler needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlm_runtime.constrained.compiler import (
        ConstraintCompiler,
        IndexCache,
        default_cache_dir,
        validate_constraint,
    )
    from radixlm_runtime.constrained.grammar import RegexGuide
    from radixlm_runtime.constrained.json_schema import (
        REGEX_BOOL,
        REGEX_FLOAT,
        REGEX_INT,
        REGEX_STR,
        build_regex_from_schema,
        regex_for_dtype,
    )
    from radixlm_runtime.constrained.jump_forward import Jump, plan_jump
    from radixlm_runtime.constrained.regex_fsm import CharDFA, TokenIndex, TokenVocab, build_token_index

_MODULES = {
    "radixlm_runtime.constrained.compiler": [
        "ConstraintCompiler",
        "IndexCache",
        "default_cache_dir",
        "validate_constraint",
    ],
    "radixlm_runtime.constrained.grammar": ["RegexGuide"],
    "radixlm_runtime.constrained.json_schema": [
        "REGEX_BOOL",
        "REGEX_FLOAT",
        "REGEX_INT",
        "REGEX_STR",
        "build_regex_from_schema",
        "regex_for_dtype",
    ],
    "radixlm_runtime.constrained.jump_forward": ["Jump", "plan_jump"],
    "radixlm_runtime.constrained.regex_fsm": ["CharDFA", "TokenIndex", "TokenVocab", "build_token_index"],
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "CharDFA",
    "ConstraintCompiler",
    "IndexCache",
    "Jump",
    "RegexGuide",
    "TokenIndex",
    "TokenVocab",
    "build_regex_from_schema",
    "build_token_index",
    "default_cache_dir",
    "plan_jump",
    "regex_for_dtype",
    "validate_constraint",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'radixlm_runtime.constrained' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
