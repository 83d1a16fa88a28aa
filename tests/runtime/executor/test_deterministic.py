"""--deterministic on the default model: a request's tokens and logprobs are bit-identical whatever it
is batched with, whether its prefix came from the radix cache, and however its prompt was chunked.
Without the flag the logprobs differ in the last bits (checked too, so the test keeps meaning
something)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import radixlm_runtime as rt
from radixlm_runtime.layers.linear import Linear

pytestmark = pytest.mark.slow

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PREFIX = "You are a careful assistant. Answer briefly and exactly.\n\n"
PROMPTS = [
    PREFIX + "The capital of France is",
    PREFIX + "Question: what is 12 times 7? Answer:",
    "def fib(n):\n    ",
    PREFIX + "Once upon a time, there",
]
PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def _engine(**flags: Any) -> rt.Engine:
    return rt.Engine(device=DEVICE, dtype="float32", max_total_tokens=8192, log_level="warning", **flags)


def _run(engine: rt.Engine, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(prompts, PARAMS, return_logprob=True)
    return [
        (
            [tok for _, tok, _ in out["meta_info"]["output_token_logprobs"]],
            [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
        )
        for out in outs
    ]


def _batch_variants(engine: rt.Engine) -> list[list[tuple[list[int], list[float]]]]:
    """Each prompt alone (the first one uncached), then all together, then in reverse order."""
    alone = [_run(engine, [p])[0] for p in PROMPTS]
    together = _run(engine, PROMPTS)
    reverse = _run(engine, PROMPTS[::-1])[::-1]
    return [alone, together, reverse]


def test_same_result_alone_batched_and_cached() -> None:
    engine = _engine(deterministic=True)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    if DEVICE == "cuda":  # every linear on the invariant Triton matmul, none in row blocks
        assert all(m.invariant_matmul and not m.row_block for m in linears)
    else:  # the float32 panel kernels are batch-invariant as they are; other kernels run in row blocks
        assert all((m.batch_invariant or m.row_block) and not m.invariant_matmul for m in linears)
    alone, together, reverse = _batch_variants(engine)
    assert alone == together == reverse


def test_same_result_without_cache_and_with_small_chunks() -> None:
    reference = _run(_engine(deterministic=True), PROMPTS)
    uncached = _run(_engine(deterministic=True, disable_radix_cache=True), PROMPTS)
    chunked = _run(_engine(deterministic=True, chunked_prefill_size=16, disable_radix_cache=True), PROMPTS)
    assert reference == uncached == chunked


def test_default_mode_is_not_batch_invariant() -> None:
    """What the flag buys: by default, batching changes some logprobs in their last bits."""
    alone, together, reverse = _batch_variants(_engine())
    assert [ids for ids, _ in alone] == [ids for ids, _ in together]
    assert alone != together or together != reverse
