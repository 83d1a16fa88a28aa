"""llguidance backend: constraints become llguidance grammars; a compiled grammar is a matcher at its
start state, which each request deep-copies (microseconds).

llguidance compiles lazily (its lexer builds DFA states on demand), so even large schemas compile in
milliseconds and the per-token mask is computed on the fly within its resource limits.
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import numpy as np
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from radixlm_runtime.constrained.backend import complete_utf8_prefix, fit_bitmask
from radixlm_runtime.constrained.constraint import JSON_SEPARATORS, Constraint, closed_objects, parse_schema

_JSON_OPTIONS: Any = {
    "whitespace_flexible": False,
    "item_separator": JSON_SEPARATORS[0],
    "key_separator": JSON_SEPARATORS[1],
}


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint; ValueError naming its field when it cannot be
    converted. An ebnf is GBNF (`root ::= ...`, as SGLang and xgrammar take it) or Lark."""
    if constraint.kind == "regex":
        # `\d` is [0-9], as xgrammar and JSON Schema read it (Rust's regex would take any Unicode digit).
        return LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(constraint.text, 'd')}/")
    if constraint.kind == "json_schema":
        schema = closed_objects(parse_schema(constraint.text))
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except ValueError as e:
            raise constraint.error(str(e)) from None
    try:
        lark = any_to_lark(constraint.text)
    except Exception as e:  # the converter raises bare Exceptions for undefined rules
        raise constraint.error(f"invalid grammar: {e}") from None
    return LLMatcher.grammar_from_lark(lark)


def check(constraint: Constraint) -> str:
    """The constraint's grammar (llguidance's JSON grammar text), parsed and validated once:
    ValueError naming its field when llguidance refuses it or would not enforce part of it."""
    grammar = grammar_of(constraint)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:
        # Warnings name what llguidance would not enforce (e.g. unimplemented keys): refused too.
        raise constraint.error("; ".join(m.strip() for m in messages))
    return grammar


class Backend:
    def __init__(self, tokenizer: Any, eos_ids: frozenset[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=max(vocab_size, len(tokenizer)), eos_token=sorted(eos_ids)
        )

    def compile(self, constraint: Constraint, grammar: str | None = None) -> LLMatcher:
        matcher = LLMatcher(self.tokenizer, grammar or check(constraint), log_level=0)
        if matcher.is_error():
            raise constraint.error(matcher.get_error())
        return matcher

    def guide(self, compiled: LLMatcher) -> LLGuidanceGuide:
        return LLGuidanceGuide(compiled.deep_copy())


class LLGuidanceGuide:
    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher

    def allowed_mask(self, vocab_size: int) -> np.ndarray:
        return fit_bitmask(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32), vocab_size)

    def advance(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the constraint: {self.matcher.get_error()}")

    def advance_tokens(self, token_ids: list[int]) -> bool:
        if self.matcher.validate_tokens(token_ids) != len(token_ids):
            return False
        return self.matcher.consume_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if not self.matcher.rollback(num_tokens):
            error = self.matcher.get_error()
            raise ValueError(f"cannot roll the constraint back by {num_tokens} tokens: {error}")

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def is_finished(self) -> bool:
        return self.matcher.is_stopped()

    def jump_forward(self) -> str | None:
        return complete_utf8_prefix(self.matcher.compute_ff_bytes()) or None

    def error(self) -> str | None:
        # After an error the matcher allows only EOS and reports itself stopped: without this check
        # the request would end as an empty, successful stop.
        if not self.matcher.is_error():
            return None
        # The message's first line says why; the rest dumps the parser state and the whole grammar.
        return self.matcher.get_error().strip().split("\n", 1)[0] or "llguidance stopped with an error"
