"""A new JSON schema is parsed and checked once per request: by the request builder's check, whose
checked grammar travels in the GenerateReq (msgpack, as between the HTTP and scheduler processes)
to the scheduler's compile, which does not parse the schema again. A spy counts the parses."""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import radixlm_runtime as rt
from radixlm_runtime.config import ServerConfig
from radixlm_runtime.constrained.checker import GrammarChecker
from radixlm_runtime.constrained.compiler import GrammarCompiler
from radixlm_runtime.constrained.constraint import Constraint, parse_schema
from radixlm_runtime.io import messages as msg
from radixlm_runtime.io.limits import RequestLimits
from radixlm_runtime.io.request_builder import PromptArgs, RequestPolicy, build_requests
from radixlm_runtime.io.tokenizer import eos_token_ids, load_tokenizer

BACKENDS = ("llguidance", "xgrammar")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}}, "required": ["name"]}


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The schema texts parse_schema is called on, in both backends, in this process."""
    seen: list[str] = []

    def spy(text: str) -> Any:
        seen.append(text)
        return parse_schema(text)

    for name in BACKENDS:
        if importlib.util.find_spec(name):  # xgrammar is an extra: a bare GPU image lacks it
            monkeypatch.setattr(_module(name), "parse_schema", spy)
    yield seen


def _module(backend: str) -> Any:
    return importlib.import_module(f"radixlm_runtime.constrained.{backend}_backend")


@pytest.mark.parametrize("backend", BACKENDS)
def test_checked_grammar_crosses_the_wire_and_compiles_unparsed(
    backend: str, tiny_llama_dir: Path, parses: list[str]
) -> None:
    """The server's path, both halves in this process: the HTTP side's builder check, then the
    message through msgpack, then the scheduler's compile of what arrived."""
    pytest.importorskip(backend)
    tokenizer = load_tokenizer(tiny_llama_dir)
    limits = RequestLimits(300, 256, 4096)
    policy = RequestPolicy.of(limits, eos_token_ids(tokenizer, []), {}, ServerConfig())
    checker = GrammarChecker(backend, workers=1)
    text = json.dumps(SCHEMA | {"title": backend})  # new to this process
    prompt = PromptArgs([5, 6, 7], {"json_schema": text, "max_new_tokens": 32})
    (built,) = build_requests([prompt], policy, checker.check)
    assert parses == [text]

    arrived = msg.decode_to_scheduler(msg.encode(built.samples[0]))
    assert isinstance(arrived, msg.GenerateReq) and arrived.grammar == built.samples[0].grammar
    module = _module(backend)
    compiler = GrammarCompiler(
        lambda: module.Backend(tokenizer, frozenset(eos_token_ids(tokenizer, [])), 300)
    )
    constraint = arrived.sampling_params.constraint
    assert constraint == Constraint("json_schema", text)
    guide = compiler.guide(compiler.submit(constraint, arrived.grammar).result(timeout=60))
    assert guide.allowed_mask(300).any()
    assert parses == [text]  # the compile parsed nothing

    # The same schema again: remembered by the checker, compiled already.
    (again,) = build_requests([prompt], policy, checker.check)
    compiler.compile(constraint, again.samples[0].grammar)
    assert parses == [text]
    compiler.shutdown()
    checker.shutdown()


def test_engine_request_parses_its_schema_once(tiny_llama_dir: Path, parses: list[str]) -> None:
    """One constrained Engine request (builder, then the scheduler's compile): one parse, and its
    output is valid under the schema."""
    text = json.dumps(SCHEMA | {"title": "engine"})
    with rt.Engine(str(tiny_llama_dir), max_total_tokens=4096, context_length=256, log_level="warning") as e:
        out = e.generate("the theater", {"json_schema": text, "max_new_tokens": 32, "temperature": 0})
        assert parses == [text]
        assert isinstance(json.loads(out["text"])["name"], str)
        e.generate("the theater", {"json_schema": text, "max_new_tokens": 32, "temperature": 0})
        assert parses == [text]


def test_unchecked_constraint_is_checked_by_the_compile(tiny_llama_dir: Path, parses: list[str]) -> None:
    """A message sent without a checked grammar (e.g. by a client of the scheduler that skips the
    builder) is still checked, once, by the compile; a bad schema is refused there."""
    tokenizer = load_tokenizer(tiny_llama_dir)
    backend = _module("llguidance").Backend(tokenizer, frozenset(eos_token_ids(tokenizer, [])), 300)
    text = json.dumps(SCHEMA | {"title": "unchecked"})
    backend.compile(Constraint("json_schema", text))
    assert parses == [text]
    with pytest.raises(ValueError, match="unsupported keyword 'uniqueItems'"):
        backend.compile(Constraint("json_schema", json.dumps({"type": "array", "uniqueItems": True})))


def test_concurrent_requests_with_one_new_constraint_share_its_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's checker: four requests carrying the same new schema at once wait for one check."""
    import radixlm_runtime.constrained.checker as checker_module

    calls: list[Constraint] = []

    def slow_check(backend: str, constraint: Constraint) -> str:
        calls.append(constraint)
        time.sleep(0.3)  # long enough for the other callers to arrive meanwhile
        return f"grammar of {constraint.text}"

    monkeypatch.setattr(checker_module, "check_constraint", slow_check)
    checker = GrammarChecker("llguidance", workers=2)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    with ThreadPoolExecutor(4) as callers:
        results = list(callers.map(lambda _: checker.check(constraint), range(4)))
    assert results == [f"grammar of {constraint.text}"] * 4 and calls == [constraint]
    assert checker.check(constraint) == results[0] and len(calls) == 1
    checker.shutdown()
