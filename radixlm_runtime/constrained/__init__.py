"""Constrained decoding: regex / JSON Schema → character DFA → token-level index → per-request guide."""

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
