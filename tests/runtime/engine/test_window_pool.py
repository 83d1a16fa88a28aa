"""Sliding-window layers in window slots of their own (--swa-full-tokens-ratio, kvcache/pool.py): on
tiny Gemma 3 (one full layer of three) and Mistral (every layer windowed), with so few window slots
that the tree's windows are evicted all the time, the tokens equal those of the one-pool engine, a
cached run equals an uncached one, and every slot of both kinds is back once the cache is flushed."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

import radixlm_runtime as rt

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from family_models import WINDOW, build_family_dir  # noqa: E402

PARAMS = {"temperature": 0, "max_new_tokens": 3 * WINDOW, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    """12 prompts on one 100-token prefix (6x the window), each with its own tail."""
    rng = random.Random(0)
    base = [rng.randrange(10, 200) for _ in range(100)]
    return [base + [rng.randrange(10, 200) for _ in range(rng.randrange(1, 60))] for _ in range(12)]


def _engine(model_dir: Path, backend: str, ratio: float) -> rt.Engine:
    return rt.Engine(
        str(model_dir),
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        max_total_tokens=4096,
        chunked_prefill_size=64,
        swa_full_tokens_ratio=ratio,
        log_level="warning",
    )


@pytest.mark.parametrize(("family", "backend"), [("gemma3", "cpu"), ("mistral", "torch")])
def test_window_slots_change_no_token(family: str, backend: str, tmp_path: Path) -> None:
    model_dir = build_family_dir(tmp_path, family)
    prompts = _prompts()
    one_pool = _engine(model_dir, backend, 1.0)
    try:
        assert one_pool.scheduler.runner_info.window_slots == 0
        want = [o["output_ids"] for o in one_pool.generate(input_ids=prompts, sampling_params=PARAMS)]
    finally:
        one_pool.shutdown()

    eng = _engine(model_dir, backend, 0.01)
    try:
        info = eng.scheduler.runner_info
        # The floor: the largest step (64) and two windows.
        assert info.window_slots == 64 + 2 * WINDOW and info.sliding_window == WINDOW
        first = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=PARAMS)]
        again = eng.generate(input_ids=prompts, sampling_params=PARAMS)
        assert first == want
        assert [o["output_ids"] for o in again] == want
        assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
        assert eng.flush_cache()
        alloc = eng.scheduler.cache.allocator
        assert alloc.available_size() == info.max_total_tokens
        assert alloc.windows.available_size() == info.window_slots
    finally:
        eng.shutdown()
