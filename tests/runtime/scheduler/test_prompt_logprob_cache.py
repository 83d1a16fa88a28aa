"""Prompt logprobs served from the radix tree: a request that wants every prompt token's logprob
(`echo` + `logprobs`, loglikelihood scoring) reuses the cached prefix and the logprobs an earlier
request computed for it, instead of recomputing the whole prompt."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from scheduler_helpers import assert_no_leak

import radixlm_runtime as rt

SHARED = [(7 * j) % 240 + 10 for j in range(60)]  # a few-shot prefix every question shares
QUESTIONS = [[(5 * q + 3 * j) % 230 + 12 for j in range(8 + q)] for q in range(4)]


def _values(meta: dict) -> list[float | None]:
    return [entry[0] for entry in meta["input_token_logprobs"]]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> tuple[rt.Engine, rt.Engine]:
    cached = rt.Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=4096, log_level="warning")
    fresh = rt.Engine(
        str(tiny_llama_dir),
        dtype="float32",
        max_total_tokens=4096,
        disable_radix_cache=True,
        log_level="warning",
    )
    return cached, fresh


def test_scoring_after_the_first_question_hits_the_cache(
    engines: tuple[rt.Engine, rt.Engine], prompt_logprobs: Callable[..., dict]
) -> None:
    engine, fresh = engines
    engine.flush_cache()
    first = prompt_logprobs(engine, SHARED + QUESTIONS[0])
    assert first["cached_tokens"] == 0
    for q in QUESTIONS[1:]:
        meta = prompt_logprobs(engine, SHARED + q)
        # Everything but the last shared token (recomputed: its row gives the first question token).
        assert meta["cached_tokens"] == len(SHARED) - 1, meta["cached_tokens"]
        got = _values(meta)
        want = _values(prompt_logprobs(fresh, SHARED + q))
        assert got[0] is None and want[0] is None and len(got) == len(want) == len(SHARED) + len(q)
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(got[1:], want[1:]))
        # The shared prefix's logprobs are the very values the first request computed.
        assert got[: len(SHARED)] == _values(first)[: len(SHARED)]
    assert_no_leak(engine)


def test_top_logprobs_are_cached_only_as_wide_as_computed(
    engines: tuple[rt.Engine, rt.Engine], prompt_logprobs: Callable[..., dict]
) -> None:
    engine, fresh = engines
    engine.flush_cache()
    narrow = prompt_logprobs(engine, SHARED + QUESTIONS[0], top=2)
    assert all(top is None or len(top) == 2 for top in narrow["input_top_logprobs"])
    # Wider top-k than the tree holds: those positions are recomputed, not served short.
    wide = prompt_logprobs(engine, SHARED + QUESTIONS[1], top=4)
    assert wide["cached_tokens"] == 0
    assert [len(t) for t in wide["input_top_logprobs"][1:]] == [4] * (len(SHARED) + len(QUESTIONS[1]) - 1)
    again = prompt_logprobs(engine, SHARED + QUESTIONS[2], top=3)
    assert again["cached_tokens"] == len(SHARED) - 1
    reference = prompt_logprobs(fresh, SHARED + QUESTIONS[2], top=3)
    for got, want in zip(again["input_top_logprobs"][1:], reference["input_top_logprobs"][1:]):
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert all(math.isclose(a[0], b[0], rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(got, want))
    assert_no_leak(engine)


def test_a_late_logprob_start_needs_nothing_from_the_tree(
    engines: tuple[rt.Engine, rt.Engine], prompt_logprobs: Callable[..., dict]
) -> None:
    """Scoring only a continuation (SGLang's select) uses the whole cached prefix as before."""
    engine, _ = engines
    engine.flush_cache()
    engine.generate(input_ids=SHARED + QUESTIONS[0], sampling_params={"max_new_tokens": 1})
    ids = SHARED + QUESTIONS[1]
    meta = prompt_logprobs(engine, ids, start=len(ids) - 2)
    assert meta["cached_tokens"] == len(SHARED) and len(meta["input_token_logprobs"]) == 2


def test_output_logprobs_join_the_tree(
    engines: tuple[rt.Engine, rt.Engine], prompt_logprobs: Callable[..., dict]
) -> None:
    """A generated answer scored later (a program checking its own output) is a cache hit,
    logprobs included: the sampled tokens' logprobs were stored with their KV."""
    engine, fresh = engines
    engine.flush_cache()
    ids = SHARED + QUESTIONS[3]
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
    )
    answer = out["output_ids"]
    scored = prompt_logprobs(engine, ids + answer, start=len(ids))
    assert scored["cached_tokens"] >= len(ids) + len(answer) - 2
    got = _values(scored)
    assert got[: len(answer) - 1] == [
        lp for lp, _, _ in out["meta_info"]["output_token_logprobs"][: len(answer) - 1]
    ]
    want = _values(prompt_logprobs(fresh, ids + answer, start=len(ids)))
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(got, want))
