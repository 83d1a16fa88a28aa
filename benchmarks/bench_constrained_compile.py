"""Cold vs cached compile time of a typical 6-field JSON Schema for the default model's vocabulary.

Cold = a fresh process's first compile (vocabulary preparation + DFA + token index); warm = a second
pattern once the vocabulary is prepared; cached = served from memory, and from the on-disk cache by a
new compiler. Usage: python benchmarks/bench_constrained_compile.py
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from radixlm_runtime.constrained.compiler import ConstraintCompiler, IndexCache
from radixlm_runtime.constrained.json_schema import build_regex_from_schema
from radixlm_runtime.constrained.regex_fsm import TokenVocab
from radixlm_runtime.engine.tokenizer import load_tokenizer
from radixlm_runtime.models.loader import resolve_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.com$"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "score", "active", "tags"],
}
OTHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "population": {"type": "integer"},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population"],
}

T = TypeVar("T")


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    tokenizer = load_tokenizer(resolve_model_path(None))
    pattern, other = build_regex_from_schema(SCHEMA), build_regex_from_schema(OTHER)
    with tempfile.TemporaryDirectory() as tmp:
        vocab, t_vocab = _timed(lambda: TokenVocab.from_tokenizer(tokenizer))
        _, t_trie = _timed(lambda: (vocab.trie, vocab.fingerprint))
        compiler = ConstraintCompiler(vocab, cache=IndexCache(cache_dir=Path(tmp)))
        index, t_cold = _timed(lambda: compiler.compile(pattern))
        _, t_warm = _timed(lambda: compiler.compile(other))
        _, t_mem = _timed(lambda: compiler.compile(pattern))
        fresh = ConstraintCompiler(vocab, cache=IndexCache(cache_dir=Path(tmp)))
        _, t_disk = _timed(lambda: fresh.compile(pattern))
        compiler.shutdown()
        fresh.shutdown()
    print(
        f"vocabulary: {vocab.size} ids; schema regex: {len(pattern)} chars, {index.num_states} DFA states, "
        f"{len(index.token_ids)} (state, token) edges"
    )
    print(
        f"vocab prep (once per tokenizer): {t_vocab + t_trie:.3f} s (texts {t_vocab:.3f}, trie {t_trie:.3f})"
    )
    print(f"cold compile (first schema):     {t_cold:.3f} s  -> total cold {t_vocab + t_trie + t_cold:.3f} s")
    print(f"warm compile (new 3-field schema): {t_warm:.3f} s")
    print(f"cached, memory LRU:              {t_mem * 1e3:.3f} ms")
    print(f"cached, disk (.npz):             {t_disk * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
