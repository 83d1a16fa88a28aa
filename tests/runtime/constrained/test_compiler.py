"""ConstraintCompiler: memory and disk caches, background compiles, and errors carried by futures."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import radixlm_runtime.constrained.compiler as compiler_module
from radixlm_runtime.constrained.compiler import ConstraintCompiler, IndexCache, default_cache_dir
from radixlm_runtime.constrained.regex_fsm import TokenIndex, TokenVocab

PATTERN = r'\{"id":[0-9]+,"tag":"[a-z\x00]*"\}'


def _same(a: TokenIndex, b: TokenIndex) -> None:
    for name in ("offsets", "token_ids", "next_states", "eos_ids"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert np.array_equal(a.dfa.trans, b.dfa.trans) and np.array_equal(a.dfa.accepting, b.dfa.accepting)
    assert a.dfa.char_class == b.dfa.char_class and a.dfa.other_class == b.dfa.other_class
    assert a.vocab_size == b.vocab_size


def test_memory_and_disk_cache(
    tiny_vocab: TokenVocab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = ConstraintCompiler(tiny_vocab, cache=IndexCache(cache_dir=tmp_path))
    index = first.compile(PATTERN)
    assert first.compile(PATTERN) is index
    assert len(list(tmp_path.glob("*.npz"))) == 1

    def no_compiling(*args: object, **kwargs: object) -> TokenIndex:
        raise AssertionError("should have been served from the disk cache")

    monkeypatch.setattr(compiler_module, "build_token_index", no_compiling)
    second = ConstraintCompiler(tiny_vocab, cache=IndexCache(cache_dir=tmp_path))
    loaded = second.compile(PATTERN)
    _same(index, loaded)
    assert loaded.forced_string(loaded.initial_state) == '{"id":'  # "\x00" survived the round trip
    first.shutdown()
    second.shutdown()


def test_corrupt_or_foreign_cache_files_are_misses(tiny_vocab: TokenVocab, tmp_path: Path) -> None:
    cache = IndexCache(cache_dir=tmp_path)
    ConstraintCompiler(tiny_vocab, cache=cache).compile("ab")
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(b"not a zip")
    assert IndexCache(cache_dir=tmp_path).get("ab", tiny_vocab.fingerprint) is None
    assert IndexCache(cache_dir=tmp_path).get("ab", "another-vocabulary") is None


def test_lru_eviction(tiny_vocab: TokenVocab) -> None:
    compiler = ConstraintCompiler(tiny_vocab, cache=IndexCache(max_entries=2, cache_dir=None))
    a = compiler.compile("a")
    compiler.compile("b")
    assert compiler.compile("a") is a
    compiler.compile("c")  # evicts "b", the least recently used
    assert compiler.cache.get("b", tiny_vocab.fingerprint) is None
    assert compiler.cache.get("a", tiny_vocab.fingerprint) is a


def test_submit_runs_in_the_pool_and_shares_inflight_work(tiny_vocab: TokenVocab) -> None:
    compiler = ConstraintCompiler(tiny_vocab, cache=IndexCache(cache_dir=None))
    release = threading.Event()
    real_compile = compiler.compile

    def slow_compile(pattern: str, field_name: str = "regex") -> TokenIndex:
        release.wait(5)
        return real_compile(pattern, field_name)

    compiler.compile = slow_compile  # type: ignore[method-assign]
    f1, f2 = compiler.submit("[0-9]+"), compiler.submit("[0-9]+")
    assert f1 is f2 and not f1.done()
    release.set()
    assert f1.result(5).is_accepting(f1.result().next_state(0, tiny_vocab.texts.index("7")))
    compiler.shutdown()


def test_errors_surface_through_futures(tiny_vocab: TokenVocab) -> None:
    compiler = ConstraintCompiler(tiny_vocab, cache=IndexCache(cache_dir=None))
    with pytest.raises(ValueError, match="^regex: unsupported construct: backreference"):
        compiler.submit(r"(a)\1").result(5)
    with pytest.raises(ValueError, match="^json_schema: enum must be a non-empty list"):
        compiler.submit_constraint(json_schema={"enum": []}).result(5)
    with pytest.raises(ValueError, match="^json_schema: unsupported construct"):
        compiler.submit("(?=a)a", field_name="json_schema").result(5)
    index = compiler.submit_constraint(json_schema='{"type": "boolean"}').result(5)
    assert index.forced_string(index.initial_state) is None
    with pytest.raises(ValueError, match="exactly one"):
        compiler.submit_constraint()
    compiler.shutdown()


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "fsm"
    monkeypatch.delenv("RADIXLM_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "radixlm" / "fsm"
