"""The grammar-backend interface: compile a constraint for one vocabulary, then track each request
through it with a `Guide`.

Both backends (llguidance, the default, and xgrammar) match bytes, not token strings, so a regex
whose multi-byte character the tokenizer splits across tokens is followed exactly. Masks are int32
bitmasks over the vocabulary (bit `t % 32` of word `t // 32` set = token t allowed), the layout both
libraries fill natively and the sampler applies on the logits' own device.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import numpy as np

from radixlm_runtime.config import GRAMMAR_BACKENDS
from radixlm_runtime.constrained.constraint import Constraint

_MODULES = {
    "llguidance": "radixlm_runtime.constrained.llguidance_backend",
    "xgrammar": "radixlm_runtime.constrained.xgrammar_backend",
}


class Guide(Protocol):
    """One request's position in its compiled constraint. The scheduler asks it for the next
    token's mask, advances it on every output token, and rolls it back when output is rewritten
    (jump-forward retokenization, rejected speculative tokens)."""

    def allowed_mask(self, vocab_size: int) -> np.ndarray:
        """int32 [ceil(vocab_size / 32)] bitmask of the tokens allowed next (EOS only where the
        output is complete)."""
        ...

    def advance(self, token_id: int) -> None:
        """Consumes one output token; ValueError when the constraint does not allow it (or the
        engine fails on it)."""
        ...

    def advance_tokens(self, token_ids: list[int]) -> bool:
        """Consumes all of token_ids when the constraint allows them all; else changes nothing and
        returns False."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens advanced tokens."""
        ...

    def is_accepting(self) -> bool:
        """The output so far is a complete match."""
        ...

    def is_finished(self) -> bool:
        """The request should end: EOS was consumed, or the output is complete and cannot grow."""
        ...

    def jump_forward(self) -> str | None:
        """Text every valid continuation starts with, which the runtime may append without decode
        steps; None when the next character is not determined."""
        ...

    def error(self) -> str | None:
        """Why the grammar engine gave up on this request (a resource limit such as llguidance's
        ParserTooComplex, or no token of the vocabulary continuing the output); None while it
        works. Once set, the guide is unusable: its mask no longer follows the constraint."""
        ...


class GrammarBackend(Protocol):
    """A grammar library bound to one tokenizer; compile runs on worker threads."""

    def compile(self, constraint: Constraint, grammar: str | None = None) -> Any:
        """The compiled grammar; ValueError naming the constraint's field when it is refused.
        `grammar` is the constraint's grammar as `check_constraint` returned it: compiled without
        parsing and checking the constraint again (None: checked here)."""
        ...

    def guide(self, compiled: Any) -> Guide:
        """A fresh guide at the start of `compiled` (cheap: one per request)."""
        ...


def load_backend_module(name: str) -> Any:
    """The backend's module; a clear error when its library is not installed."""
    if name not in _MODULES:
        raise ValueError(f"grammar_backend must be one of {list(GRAMMAR_BACKENDS)}, got {name!r}")
    try:
        return importlib.import_module(_MODULES[name])
    except ImportError as e:
        raise ImportError(
            f"grammar backend {name!r} needs the {name} package: pip install {name} ({e})"
        ) from e


def make_backend(name: str, tokenizer: Any, eos_ids: frozenset[int], vocab_size: int) -> GrammarBackend:
    """The named backend for this tokenizer (slow: it indexes the vocabulary, ~0.5 s)."""
    return load_backend_module(name).Backend(tokenizer, eos_ids, vocab_size)


def check_constraint(name: str, constraint: Constraint) -> str:
    """The constraint's grammar on this backend, parsed and checked once, as text: what a request
    carries to the scheduler (io/messages.py GenerateReq.grammar), whose compile then skips the
    parse. Refuses (ValueError naming the field) a constraint the backend would refuse to compile,
    without a tokenizer: cheap enough to run before a request is queued."""
    return load_backend_module(name).check(constraint)


def bit_allowed(bits: np.ndarray, token_id: int) -> bool:
    """Whether the bitmask allows token_id."""
    return bool((int(bits[token_id >> 5]) >> (token_id & 31)) & 1)


def fit_bitmask(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """The bitmask resized to the model's vocabulary: tokens past the tokenizer's are never allowed."""
    words = (vocab_size + 31) // 32
    if len(bits) == words:
        return bits
    out = np.zeros(words, dtype=np.int32)
    n = min(words, len(bits))
    out[:n] = bits[:n]
    return out


def complete_utf8_prefix(data: bytes) -> str:
    """The longest prefix of data that is whole UTF-8 characters (forced bytes may end mid-character)."""
    for end in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:end].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""
