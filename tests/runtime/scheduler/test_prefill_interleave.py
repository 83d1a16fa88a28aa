"""Long prefills must not stall everyone: a short prompt that arrives while a long one is being
chunked runs ahead of the long one's remaining chunks, running decodes get a token in every step
that carries a chunk, and the step's token budget follows the measured step times. Asserted on the
scheduled steps, never on wall-clock time; greedy outputs must not change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from scheduler_helpers import assert_no_leak, message

import radixlm_runtime as rt
from radixlm_runtime.scheduler.admission import CHUNKED_SHARE, MIN_CHUNK, ScheduledItem
from radixlm_runtime.scheduler.scheduler import Scheduler
from radixlm_runtime.scheduler.step_budget import FIRST_STEP_TOKENS, StepBudget

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
DECODING = [(5 * j) % 250 + 3 for j in range(12)]
LONG = [(13 * j + 1) % 290 + 3 for j in range(240)]
SHORT = [(17 * j + 2) % 290 + 3 for j in range(10)]
BUDGET = 32


def _engine(tiny_llama_dir: Path, **kwargs: Any) -> rt.Engine:
    """A tiny engine whose steps carry up to BUDGET tokens (the fixed budget: these tests assert on
    which requests each step carries, so the budget must not depend on how fast the machine is)."""
    kwargs = {"chunked_prefill_size": BUDGET, "prefill_step_target_ms": 0, **kwargs}
    return rt.Engine(
        str(tiny_llama_dir), dtype="float32", max_total_tokens=8192, log_level="warning", **kwargs
    )


def _record_steps(sched: Scheduler) -> list[list[ScheduledItem]]:
    """Every step's scheduled items, from now on."""
    steps: list[list[ScheduledItem]] = []
    schedule = sched.admission.schedule

    def recorded() -> list[ScheduledItem]:
        items = schedule()
        if items:
            steps.append(list(items))
        return items

    sched.admission.schedule = recorded  # type: ignore[method-assign]
    return steps


@pytest.fixture(scope="module")
def alone(tiny_llama_dir: Path) -> dict[str, list[int]]:
    """Each request's greedy output when it runs by itself."""
    engine = _engine(tiny_llama_dir)
    prompts = {"decoding": DECODING, "long": LONG, "short": SHORT}
    return {k: engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for k, p in prompts.items()}


def _long_with_short_behind(engine: rt.Engine) -> tuple[list[list[ScheduledItem]], dict[str, Any]]:
    """A request decodes; a long prompt arrives and starts chunking; a short prompt arrives after
    the long one's first chunk. Runs everything to the end and returns the steps from the long
    prompt's arrival on, and the requests."""
    sched = engine.scheduler
    reqs = {"decoding": sched.submit(message("decoding", DECODING, GREEDY))}
    while reqs["decoding"].output_len < 2:
        sched.step()
    steps = _record_steps(sched)
    reqs["long"] = sched.submit(message("long", LONG, GREEDY))
    sched.step()
    assert sched.admission.partial == [reqs["long"]]
    reqs["short"] = sched.submit(message("short", SHORT, GREEDY))
    while sched.has_work():
        sched.step()
    return steps, reqs


def _first_step(steps: list[list[ScheduledItem]], rid: str) -> int:
    return next(i for i, items in enumerate(steps) if any(it.req.rid == rid for it in items))


def _last_step(steps: list[list[ScheduledItem]], rid: str) -> int:
    return max(i for i, items in enumerate(steps) if any(it.req.rid == rid and it.is_prefill for it in items))


def _assert_every_chunk_step_decodes(steps: list[list[ScheduledItem]]) -> None:
    """Every step that carries one of the long prompt's chunks also carries the running decode's
    next token, and the long prompt advances in each by at least MIN_CHUNK tokens (its last chunk
    excepted)."""
    for i in range(_first_step(steps, "long"), _last_step(steps, "long") + 1):
        rids = [it.req.rid for it in steps[i]]
        assert "decoding" in rids, (i, rids)
        [chunk] = [it for it in steps[i] if it.req.rid == "long"]
        assert chunk.extend_len >= MIN_CHUNK or chunk.completes


def test_short_prompt_runs_ahead_of_long_prompts_remaining_chunks(
    tiny_llama_dir: Path, alone: dict[str, list[int]]
) -> None:
    engine = _engine(tiny_llama_dir)
    steps, reqs = _long_with_short_behind(engine)
    long_first, long_last = _first_step(steps, "long"), _last_step(steps, "long")
    assert long_last - long_first >= 6  # 240 tokens under a 32-token budget: many chunks
    # The short prompt was prefilled whole in the step right after it arrived, while the long one
    # still had chunks to go; its first token came first.
    short = _first_step(steps, "short")
    assert short == long_first + 1 < long_last
    [item] = [it for it in steps[short] if it.req.rid == "short"]
    assert item.completes and item.extend_len == len(SHORT)
    assert reqs["short"].first_token_time < reqs["long"].first_token_time
    _assert_every_chunk_step_decodes(steps)
    assert all(sum(it.extend_len for it in items) <= BUDGET for items in steps)
    assert engine.scheduler.stats.interleaved_prefills == 1
    assert {rid: r.output_ids for rid, r in reqs.items()} == alone
    assert_no_leak(engine)


def test_interleave_disabled_keeps_the_long_prompt_first(
    tiny_llama_dir: Path, alone: dict[str, list[int]]
) -> None:
    """The old order: the short prompt waits until the long prompt's last chunk."""
    engine = _engine(tiny_llama_dir, disable_prefill_interleave=True)
    steps, reqs = _long_with_short_behind(engine)
    assert _first_step(steps, "short") >= _last_step(steps, "long")
    _assert_every_chunk_step_decodes(steps)
    assert engine.scheduler.stats.interleaved_prefills == 0
    assert {rid: r.output_ids for rid, r in reqs.items()} == alone
    assert_no_leak(engine)


def test_a_stream_of_short_prompts_never_stalls_the_long_one(
    tiny_llama_dir: Path, alone: dict[str, list[int]]
) -> None:
    """Short prompts keep arriving (more than a step's budget of them each step): the long prompt
    still gets a chunk in every step until it is done."""
    engine = _engine(tiny_llama_dir)
    sched = engine.scheduler
    steps = _record_steps(sched)
    long = sched.submit(message("long", LONG, GREEDY))
    shorts = []
    while long.kv_len < len(LONG):
        shorts += [sched.submit(message(f"s{len(shorts) + i}", SHORT, GREEDY)) for i in range(3)]
        sched.step()
    assert all(any(it.req is long for it in items) for items in steps)
    assert sched.stats.interleaved_prefills > 0
    while sched.has_work():
        sched.step()
    assert long.output_ids == alone["long"]
    assert all(r.output_ids == alone["short"] for r in shorts)
    assert_no_leak(engine)


def test_a_much_shorter_prompt_starts_chunking_ahead(
    tiny_llama_dir: Path, alone: dict[str, list[int]]
) -> None:
    """A prompt longer than a step's budget but much shorter than a long prompt's remainder does not
    wait for the long prompt's last chunk: it starts chunking too, and the two share the following
    steps shortest remainder first, the long prompt keeping its share of each step."""
    medium = [(11 * j + 5) % 290 + 3 for j in range(3 * BUDGET)]
    alone_medium = _engine(tiny_llama_dir).generate(input_ids=medium, sampling_params=GREEDY)["output_ids"]
    engine = _engine(tiny_llama_dir)
    sched = engine.scheduler
    steps = _record_steps(sched)
    long = sched.submit(message("long", LONG, GREEDY))
    sched.step()
    mid = sched.submit(message("medium", medium, GREEDY))
    sched.step()
    assert sched.admission.partial == [long, mid]
    while mid.output_len == 0:
        sched.step()
    assert long.kv_len < len(LONG)  # medium got its first token while long still had chunks to go
    for items in steps[1:]:
        chunks = {it.req.rid: it.extend_len for it in items if it.is_prefill}
        if "long" in chunks and "medium" in chunks:
            assert chunks["long"] >= MIN_CHUNK or long.kv_len == len(LONG)
            assert chunks["medium"] >= chunks["long"]
    while sched.has_work():
        sched.step()
    assert long.output_ids == alone["long"] and mid.output_ids == alone_medium
    assert not sched.admission.partial
    assert_no_leak(engine)


def test_steps_carry_what_the_step_budget_allows(tiny_llama_dir: Path, alone: dict[str, list[int]]) -> None:
    engine = _engine(tiny_llama_dir, chunked_prefill_size=512)
    engine.scheduler.admission.step_budget = StepBudget(max_tokens=40, target_s=0.0)
    steps, reqs = _long_with_short_behind(engine)
    assert all(sum(it.extend_len for it in items) <= 40 for items in steps)
    assert _last_step(steps, "long") - _first_step(steps, "long") >= 240 // 40
    assert {rid: r.output_ids for rid, r in reqs.items()} == alone
    assert_no_leak(engine)


def test_every_step_is_measured(tiny_llama_dir: Path) -> None:
    """The scheduler times every step it runs: the budget sees each one's tokens, and the first
    step, before anything was measured, is small."""
    engine = _engine(tiny_llama_dir, chunked_prefill_size=512, prefill_step_target_ms=250)
    sched = engine.scheduler
    steps = _record_steps(sched)
    budget = sched.admission.step_budget
    seen: list[int] = []
    observe = budget.observe
    budget.observe = lambda shape, seconds: (seen.append(shape.tokens), observe(shape, seconds))  # type: ignore[method-assign]
    engine.generate(input_ids=LONG, sampling_params=GREEDY)
    assert seen == [sum(it.extend_len for it in items) for items in steps]
    assert seen[0] == FIRST_STEP_TOKENS


def test_a_step_that_completes_a_prompt_ends_early(tiny_llama_dir: Path, alone: dict[str, list[int]]) -> None:
    """The step in which a shorter prompt finishes gives the long prompt its share and no more: what
    the short one leaves of the budget would only hold its first token back behind a long chunk (at
    a long prompt's context, the costliest tokens a step can carry)."""
    medium = [(11 * j + 5) % 290 + 3 for j in range(3 * BUDGET)]
    engine = _engine(tiny_llama_dir)
    sched = engine.scheduler
    steps = _record_steps(sched)
    reqs = {"long": sched.submit(message("long", LONG, GREEDY))}
    sched.step()
    reqs["short"] = sched.submit(message("short", SHORT, GREEDY))
    sched.step()
    reqs["medium"] = sched.submit(message("medium", medium, GREEDY))
    while sched.has_work():
        sched.step()
    # A tenth of this budget is under MIN_CHUNK, so the long prompt's share is MIN_CHUNK exactly
    # (whatever decode and admitted tokens took from the budget first).
    assert int(BUDGET * CHUNKED_SHARE) <= MIN_CHUNK
    completing = 0
    for items in steps[1:]:
        chunks = {it.req.rid: it for it in items if it.is_prefill}
        if "long" not in chunks:
            continue
        others = [it for rid, it in chunks.items() if rid != "long"]
        if any(it.completes for it in others):
            completing += 1
            assert chunks["long"].extend_len == MIN_CHUNK, {rid: it.extend_len for rid, it in chunks.items()}
            assert sum(it.extend_len for it in items) < BUDGET
        elif not chunks["long"].completes:
            assert sum(it.extend_len for it in items) == BUDGET  # otherwise the long prompt fills the step
    assert completing == 2  # the short prompt's one step and the medium one's last
    assert reqs["long"].output_ids == alone["long"] and reqs["short"].output_ids == alone["short"]
    assert_no_leak(engine)
