"""xgrammar backend (`--grammar-backend xgrammar`): constraints compile ahead of time into xgrammar's
CompiledGrammar (an adaptive token mask cache per grammar state); each request gets a GrammarMatcher.

xgrammar imports torch, so this module is only loaded when the backend is selected.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xgrammar as xgr

from radixlm_runtime.constrained.backend import fit_bitmask
from radixlm_runtime.constrained.constraint import JSON_SEPARATORS, Constraint, parse_schema, subschemas


def grammar_of(constraint: Constraint) -> xgr.Grammar:
    """The constraint parsed once into xgrammar's Grammar; ValueError naming its field when refused."""
    try:
        if constraint.kind == "regex":
            return xgr.Grammar.from_regex(constraint.text)
        if constraint.kind == "json_schema":
            _check_xgrammar_schema(parse_schema(constraint.text))
            return xgr.Grammar.from_json_schema(
                constraint.text, any_whitespace=False, separators=JSON_SEPARATORS
            )
        return xgr.Grammar.from_ebnf(constraint.text)
    except RuntimeError as e:
        raise constraint.error(str(e).strip()) from None


def check(constraint: Constraint) -> str:
    """The constraint's grammar, parsed and validated once, as xgrammar's serialized JSON (it
    crosses to the scheduler process); ValueError naming its field when refused."""
    return grammar_of(constraint).serialize_json()


def _check_xgrammar_schema(schema: Any) -> None:
    """What xgrammar would ignore with only a warning: refused instead."""
    for path, sub in subschemas(schema):
        if "pattern" in sub and ("minLength" in sub or "maxLength" in sub):
            raise ValueError(
                f"json_schema: pattern with minLength/maxLength at {path} is not supported by the xgrammar "
                "backend (use --grammar-backend llguidance)"
            )


class Backend:
    def __init__(self, tokenizer: Any, eos_ids: frozenset[int], vocab_size: int) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=max(vocab_size, len(tokenizer)), stop_token_ids=sorted(eos_ids)
        )
        # The stop tokens as a bitmask over the tokenizer's vocabulary (the matcher's mask layout).
        self.eos_mask = np.zeros((info.vocab_size + 31) // 32, dtype=np.uint32)
        for t in eos_ids:
            self.eos_mask[t // 32] |= np.uint32(1 << (t % 32))
        self.eos_mask = self.eos_mask.view(np.int32)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, constraint: Constraint, grammar: str | None = None) -> xgr.CompiledGrammar:
        parsed = xgr.Grammar.deserialize_json(grammar) if grammar else grammar_of(constraint)
        try:
            return self.compiler.compile_grammar(parsed)
        except RuntimeError as e:
            raise constraint.error(str(e).strip()) from None

    def guide(self, compiled: xgr.CompiledGrammar) -> XGrammarGuide:
        return XGrammarGuide(xgr.GrammarMatcher(compiled), self.eos_mask)


class XGrammarGuide:
    def __init__(self, matcher: xgr.GrammarMatcher, eos_mask: np.ndarray) -> None:
        self.matcher = matcher
        self.eos_mask = eos_mask
        self._buffer = np.empty((1, len(eos_mask)), dtype=np.int32)
        self._filled = False  # whether _buffer holds the current state's mask

    def allowed_mask(self, vocab_size: int) -> np.ndarray:
        if not self._filled:
            self.matcher.fill_next_token_bitmask(self._buffer)
            self._filled = True
        return fit_bitmask(self._buffer[0].copy(), vocab_size)

    def error(self) -> str | None:
        """xgrammar has no failed state: a token it refuses leaves the matcher as it was (`advance`
        raises), and a mask that allows nothing shows up as such a refusal of the sampled token."""
        return None

    def advance(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the constraint")
        self._filled = False

    def advance_tokens(self, token_ids: list[int]) -> bool:
        for n, token_id in enumerate(token_ids):
            if not self.matcher.accept_token(token_id):
                if n:
                    self.matcher.rollback(n)
                return False
        self._filled = False
        return True

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self._filled = False

    def is_accepting(self) -> bool:
        return self.matcher.is_terminated() or self.matcher.is_completed()

    def is_finished(self) -> bool:
        """Stop token taken, or complete with nothing but a stop token allowed next."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        return not (self.allowed_mask(len(self.eos_mask) * 32) & ~self.eos_mask).any()

    def jump_forward(self) -> str | None:
        return self.matcher.find_jump_forward_string() or None
