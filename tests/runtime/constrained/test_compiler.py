"""GrammarCompiler: the backend is built once, lazily, on a worker thread; compiles are cached and
shared while in flight; errors arrive through the future naming the field."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from radixlm_runtime.constrained.backend import GrammarBackend, make_backend
from radixlm_runtime.constrained.compiler import GrammarCompiler
from radixlm_runtime.constrained.constraint import Constraint


@pytest.fixture
def counting(tiny_tokenizer: Any) -> tuple[GrammarCompiler, list[str]]:
    """A compiler whose backend records the thread that built it."""
    built: list[str] = []

    def build() -> GrammarBackend:
        built.append(threading.current_thread().name)
        return make_backend(
            "llguidance", tiny_tokenizer, frozenset({int(tiny_tokenizer.eos_token_id)}), len(tiny_tokenizer)
        )

    compiler = GrammarCompiler(build, max_entries=2)
    yield compiler, built
    compiler.shutdown()


def test_backend_built_once_on_a_worker(counting: tuple[GrammarCompiler, list[str]]) -> None:
    compiler, built = counting
    assert built == [], "nothing is built before the first constrained request"
    futures = [compiler.submit(Constraint("regex", f"a{{{i}}}")) for i in range(1, 4)]
    for f in futures:
        f.result(timeout=60)
    assert len(built) == 1 and built[0].startswith("grammar-compile")


def test_cache_and_inflight_sharing(counting: tuple[GrammarCompiler, list[str]], tiny_tokenizer: Any) -> None:
    compiler, _ = counting
    c = Constraint("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    first, second = compiler.submit(c), compiler.submit(c)
    assert first is second
    compiled = first.result(timeout=60)
    assert compiler.compile(c) is compiled
    compiler.compile(Constraint("regex", "x"))
    compiler.compile(Constraint("regex", "y"))  # max_entries=2: c is evicted
    assert compiler.compile(c) is not compiled
    guide_a, guide_b = compiler.guide(compiled), compiler.guide(compiled)
    assert guide_a.advance_tokens(tiny_tokenizer.encode('{"a":1}', add_special_tokens=False))
    assert guide_a.is_accepting() and not guide_b.is_accepting(), "each request's guide is its own"


def test_errors_surface_through_futures(counting: tuple[GrammarCompiler, list[str]]) -> None:
    compiler, _ = counting
    future = compiler.submit(Constraint("ebnf", "root ::= nowhere"))
    with pytest.raises(ValueError, match="^ebnf: "):
        future.result(timeout=60)
    assert compiler.submit(Constraint("ebnf", "root ::= nowhere")) is not future, "failures are not cached"
