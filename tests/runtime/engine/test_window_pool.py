"""Sliding-window layers in window slots of their own (--swa-full-tokens-ratio, kvcache/pool.py): on
tiny Gemma 3 (one full layer of three) and Mistral (every layer windowed), with so few window slots
that the tree's windows are evicted all the time, the tokens equal those of the one-pool engine, a
cached run equals an uncached one, and every slot of both kinds is back once the cache is flushed;
with a host KV tier under a pool too small for the conversations, follow-up turns load their
earlier turns back from the host tier, windows included, and give the same tokens."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
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


def _engine(
    model_dir: Path, backend: str, ratio: float, pool: int = 4096, host: int = 0, disk: Path | None = None
) -> rt.Engine:
    return rt.Engine(
        str(model_dir),
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        max_total_tokens=pool,
        kv_host_tokens=host,
        kv_disk_dir=str(disk) if disk is not None else None,
        chunked_prefill_size=64,
        swa_full_tokens_ratio=ratio,
        log_level="warning",
    )


def _every_slot_back(eng: rt.Engine) -> None:
    """Flushed, every token slot and window slot of the pool and the host tier is free."""
    assert eng.flush_cache()
    info, cache = eng.scheduler.runner_info, eng.scheduler.cache
    assert cache.allocator.available_size() == info.max_total_tokens
    assert cache.allocator.windows.available_size() == info.window_slots
    assert cache.tree.host_allocator.available_size() == info.host_kv_tokens
    assert cache.tree.host_allocator.windows.available_size() == info.host_window_slots


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


def _answers(eng: rt.Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [eng.generate(input_ids=p, sampling_params=PARAMS)["output_ids"] for p in prompts]


def _two_turns(eng: rt.Engine, restart: Callable[[], rt.Engine] | None = None) -> list[list[int]]:
    """Eight conversations of ~170 tokens, one request at a time: first turns, then (on an engine
    started again by `restart` where given, once `eng` is shut down) each follow-up (the first turn,
    its answer and a new question); the outputs of both turns."""
    rng = random.Random(1)
    firsts = [[rng.randrange(10, 200) for _ in range(120)] for _ in range(8)]
    questions = [[rng.randrange(10, 200) for _ in range(10)] for _ in range(8)]
    outs = _answers(eng, firsts)
    if restart is not None:
        eng.shutdown()  # written out whole to its disk tier
        eng = restart()
    follow = [p + o + q for p, o, q in zip(firsts, outs, questions, strict=True)]
    return outs + _answers(eng, follow)


@pytest.mark.parametrize(("family", "backend"), [("gemma3", "cpu"), ("mistral", "torch")])
def test_the_host_tier_brings_back_windows(family: str, backend: str, tmp_path: Path) -> None:
    model_dir = build_family_dir(tmp_path, family)
    one_pool = _engine(model_dir, backend, 1.0)
    try:
        want = _two_turns(one_pool)
    finally:
        one_pool.shutdown()

    eng = _engine(model_dir, backend, 0.01, pool=400, host=4096)
    try:
        info = eng.scheduler.runner_info
        assert info.window_slots == 64 + 2 * WINDOW
        assert info.host_window_slots == 4096 * info.window_slots // 400
        assert _two_turns(eng) == want
        stats = eng.get_server_info()
        # The follow-ups' earlier turns (~170 tokens each, 8 of them in a pool of 400) came back
        # from the host tier, ending where the host kept their windows.
        assert stats["host_hit_tokens"] >= 8 * 120
        assert stats["host_loaded_tokens"] >= stats["host_hit_tokens"]
        # Bytes moved count the windows' rows beside the tokens'.
        assert stats["host_loaded_bytes"] > stats["host_loaded_tokens"] * stats["kv_bytes_per_token"]
        assert stats["host_window_slots"] == info.host_window_slots
        assert stats["free_host_window_slots"] < info.host_window_slots
        _every_slot_back(eng)
    finally:
        eng.shutdown()


def test_a_restart_serves_follow_ups_with_their_windows_from_disk(tmp_path: Path) -> None:
    """Window slots under a host and a disk tier: the first turns are written to disk with the windows
    before their ends, and a server started again on the directory serves every follow-up's earlier
    turn from disk, windows included, with the one-pool engine's tokens."""
    model_dir = build_family_dir(tmp_path, "gemma3")
    one_pool = _engine(model_dir, "cpu", 1.0)
    try:
        want = _two_turns(one_pool)
    finally:
        one_pool.shutdown()

    def tiered() -> rt.Engine:
        return _engine(model_dir, "cpu", 0.01, pool=400, host=400, disk=tmp_path / "kv")

    first = tiered()
    assert first.scheduler.runner_info.window_slots == 64 + 2 * WINDOW
    started: list[rt.Engine] = []
    try:
        assert _two_turns(first, lambda: started.append(tiered()) or started[0]) == want
        (again,) = started
        stats = again.get_server_info()
        assert stats["disk_hit_tokens"] >= 8 * 120
        assert stats["disk_loaded_bytes"] > stats["disk_loaded_tokens"] * stats["kv_bytes_per_token"]
        _every_slot_back(again)
    finally:
        for eng in (first, *started):
            eng.shutdown()


@pytest.mark.parametrize("disk", [False, True])
def test_batched_turns_over_the_tiers_change_no_token(disk: bool, tmp_path: Path) -> None:
    """Twelve conversations submitted at once, turn after turn (the follow-ups twice), over a 600-token
    pool with window slots and a host tier (and a disk tier): the one-pool engine's tokens, prefixes
    served from the lower tiers, and every slot and window slot of each tier back once flushed."""
    model_dir = build_family_dir(tmp_path, "gemma3")
    rng = random.Random(2)
    firsts = [[rng.randrange(10, 200) for _ in range(rng.randrange(60, 140))] for _ in range(12)]
    questions = [[rng.randrange(10, 200) for _ in range(10)] for _ in range(12)]

    def turns(eng: rt.Engine) -> list[list[int]]:
        outs = [o["output_ids"] for o in eng.generate(input_ids=firsts, sampling_params=PARAMS)]
        follow = [p + o + q for p, o, q in zip(firsts, outs, questions, strict=True)]
        for _ in range(2):
            outs += [o["output_ids"] for o in eng.generate(input_ids=follow, sampling_params=PARAMS)]
        return outs

    one_pool = _engine(model_dir, "cpu", 1.0)
    try:
        want = turns(one_pool)
    finally:
        one_pool.shutdown()
    eng = _engine(model_dir, "cpu", 0.01, pool=600, host=800, disk=tmp_path / "kv" if disk else None)
    try:
        assert turns(eng) == want
        stats = eng.get_server_info()
        assert stats["host_hit_tokens"] + stats["disk_hit_tokens"] > 0
        _every_slot_back(eng)
    finally:
        eng.shutdown()
