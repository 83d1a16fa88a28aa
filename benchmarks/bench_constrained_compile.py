"""Cold vs cached compile time of a typical 6-field JSON Schema for the default model's vocabulary.

Cold = a fresh process's first compile (vocabulary preparation + DFA + token index); warm = further
patterns once the vocabulary is prepared; cached = served from memory, and from the on-disk cache by a
new compiler.

    python benchmarks/bench_constrained_compile.py [--tiny]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from common import Size, Table, bench_parser, fmt, parse_sizes, pyplot, save_figure, save_result

from radixlm_runtime.constrained.compiler import ConstraintCompiler, IndexCache
from radixlm_runtime.constrained.json_schema import build_regex_from_schema
from radixlm_runtime.constrained.regex_fsm import TokenVocab
from radixlm_runtime.io.tokenizer import load_tokenizer
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

NAME = "constrained_compile"
SIZES = {"warm_schemas": Size(3, 1, "distinct further schemas compiled warm")}
T = TypeVar("T")


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def other_schema(i: int) -> dict:
    """OTHER with its property names suffixed by i: a distinct regex, so never a cache hit."""
    props = {f"{k}{i}": v for k, v in OTHER["properties"].items()}
    return {"type": "object", "properties": props, "required": [f"{k}{i}" for k in OTHER["required"]]}


def plot(path: Path, stages: dict[str, float]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.barh(list(stages)[::-1], [v * 1e3 for v in stages.values()][::-1], color="C0")
    ax.set_xscale("log")
    ax.set_xlabel("ms (log scale)")
    ax.set_title("JSON schema -> token index compile")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    args, sizes = parse_sizes(ap, argv, SIZES)
    tokenizer = load_tokenizer(resolve_model_path(None))
    pattern = build_regex_from_schema(SCHEMA)
    others = [build_regex_from_schema(other_schema(i)) for i in range(sizes["warm_schemas"])]
    with tempfile.TemporaryDirectory() as tmp:
        vocab, t_vocab = _timed(lambda: TokenVocab.from_tokenizer(tokenizer))
        _, t_trie = _timed(lambda: (vocab.trie, vocab.fingerprint))
        compiler = ConstraintCompiler(vocab, cache=IndexCache(cache_dir=Path(tmp)))
        index, t_cold = _timed(lambda: compiler.compile(pattern))
        t_warm = statistics.median(_timed(lambda o=o: compiler.compile(o))[1] for o in others)
        _, t_mem = _timed(lambda: compiler.compile(pattern))
        fresh = ConstraintCompiler(vocab, cache=IndexCache(cache_dir=Path(tmp)))
        _, t_disk = _timed(lambda: fresh.compile(pattern))
        compiler.shutdown()
        fresh.shutdown()
    stages = {
        "vocabulary preparation (once per tokenizer)": t_vocab + t_trie,
        "cold compile, first schema": t_cold,
        "total cold": t_vocab + t_trie + t_cold,
        f"warm compile, new 3-field schema (median of {len(others)})": t_warm,
        "cached, memory LRU": t_mem,
        "cached, disk (.npz)": t_disk,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figure = f"{NAME}.png"
    plot(args.out_dir / figure, stages)
    table = Table(
        f"Constrained decoding: compile of a 6-field JSON schema over {vocab.size} tokens",
        ["stage", "time"],
        [[name, fmt(t * 1e3, ".3f" if t < 1e-3 else ".1f", " ms")] for name, t in stages.items()],
    )
    save_result(
        args.out_dir,
        NAME,
        {
            "vocab_size": vocab.size,
            "regex_chars": len(pattern),
            "dfa_states": index.num_states,
            "index_edges": len(index.token_ids),
            "seconds": {
                "vocab": t_vocab,
                "trie": t_trie,
                "cold": t_cold,
                "warm": t_warm,
                "memory_cache": t_mem,
                "disk_cache": t_disk,
            },
        },
        tables=[table],
        notes=[
            f"schema regex {len(pattern)} chars, {index.num_states} DFA states, {len(index.token_ids)} "
            f"(state, token) edges: **{t_vocab + t_trie + t_cold:.2f} s cold**, {t_warm * 1e3:.0f} ms warm, "
            f"{t_mem * 1e3:.3f} ms from memory, {t_disk * 1e3:.1f} ms from disk"
        ],
        figures=[figure],
        sizes=sizes,
    )


if __name__ == "__main__":
    main()
