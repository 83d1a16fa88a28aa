"""Constrained decoding on a native grammar engine (llguidance by default, or xgrammar): regex, JSON
Schema and EBNF constraints compile to grammars; each request follows its own guide, which gives the
sampler an int32 token bitmask per step.

Exports load lazily: the frontend language needs only the dtype regexes, and an HTTP-only program
must not pay for importing a grammar library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlm_runtime.constrained.backend import (
        GrammarBackend,
        Guide,
        check_constraint,
        make_backend,
    )
    from radixlm_runtime.constrained.compiler import GrammarCompiler
    from radixlm_runtime.constrained.constraint import CONSTRAINT_KINDS, Constraint, parse_schema
    from radixlm_runtime.constrained.dtypes import (
        REGEX_BOOL,
        REGEX_FLOAT,
        REGEX_INT,
        REGEX_STR,
        regex_for_dtype,
    )
    from radixlm_runtime.constrained.jump_forward import apply_jump, plan_jump

_MODULES = {
    "radixlm_runtime.constrained.backend": [
        "GrammarBackend",
        "Guide",
        "check_constraint",
        "make_backend",
    ],
    "radixlm_runtime.constrained.compiler": ["GrammarCompiler"],
    "radixlm_runtime.constrained.constraint": ["CONSTRAINT_KINDS", "Constraint", "parse_schema"],
    "radixlm_runtime.constrained.dtypes": [
        "REGEX_BOOL",
        "REGEX_FLOAT",
        "REGEX_INT",
        "REGEX_STR",
        "regex_for_dtype",
    ],
    "radixlm_runtime.constrained.jump_forward": ["apply_jump", "plan_jump"],
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "CONSTRAINT_KINDS",
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "Constraint",
    "GrammarBackend",
    "GrammarCompiler",
    "Guide",
    "apply_jump",
    "check_constraint",
    "make_backend",
    "parse_schema",
    "plan_jump",
    "regex_for_dtype",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'radixlm_runtime.constrained' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
