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
from radixlm_runtime.scheduler.admission import MIN_CHUNK, ScheduledItem
from radixlm_runtime.scheduler.scheduler import Scheduler
from radixlm_runtime.scheduler.step_budget import FIRST_STEP_TOKENS, MIN_STEP_TOKENS, StepBudget

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
    budget.observe = lambda tokens, seconds: (seen.append(tokens), observe(tokens, seconds))  # type: ignore[method-assign]
    engine.generate(input_ids=LONG, sampling_params=GREEDY)
    assert seen == [sum(it.extend_len for it in items) for items in steps]
    assert seen[0] == FIRST_STEP_TOKENS


# -- the step budget on its own -------------------------------------------------------------------


def _device(budget: StepBudget, per_step_s: float, per_token_s: float, sizes: list[int]) -> None:
    for tokens in sizes:
        budget.observe(tokens, per_step_s + per_token_s * tokens)


def test_budget_is_what_fits_the_target() -> None:
    budget = StepBudget(max_tokens=1024, target_s=0.25)
    # 10 ms a step plus 1 ms a token: 240 tokens fit 250 ms.
    _device(budget, 0.010, 0.001, [8, 200, 8, 8, 200, 9])
    assert abs(budget.tokens(0) - 240) <= 1
    # A slower device (or a busier machine) shrinks it as its steps come in.
    _device(budget, 0.010, 0.004, [8, 200] * 40)
    assert abs(budget.tokens(0) - 60) <= 1
    # A faster one grows it, never past the fixed budget.
    _device(budget, 0.001, 0.00001, [8, 200] * 40 + [512, 1024])
    assert budget.tokens(0) == 1024


def test_budget_starts_small_and_at_most_doubles() -> None:
    budget = StepBudget(max_tokens=1024, target_s=0.25)
    assert budget.tokens(0) == FIRST_STEP_TOKENS
    _device(budget, 0.0, 0.0001, [FIRST_STEP_TOKENS])
    assert budget.tokens(0) == 2 * FIRST_STEP_TOKENS
    _device(budget, 0.0, 0.0001, [2 * FIRST_STEP_TOKENS])
    assert budget.tokens(0) == 4 * FIRST_STEP_TOKENS


def test_budget_without_spread_charges_everything_to_tokens() -> None:
    """Steps all of one size cannot separate the per-step cost from the per-token one: the budget
    then errs small (every second counted per token), and never drops below MIN_STEP_TOKENS."""
    budget = StepBudget(max_tokens=1024, target_s=0.25)
    _device(budget, 0.050, 0.001, [100] * 5)
    assert abs(budget.tokens(0) - 0.25 / 0.0015) <= 1
    _device(budget, 5.0, 0.001, [100] * 100)
    assert budget.tokens(0) == MIN_STEP_TOKENS


def test_budget_while_decoding_is_a_multiple_of_the_decode_step() -> None:
    """While requests decode, a step carrying prefill is sized to 2.5 of their decode steps alone,
    whatever the target: on a machine so slow (or busy) that a decode step of 8 requests takes
    0.5 s, over a 0.1 s target, most of such a step is still prefill rather than 16 tokens; on a fast
    one, the 250 ms target would put 13 decode steps' worth into one gap of the streams."""
    slow = StepBudget(max_tokens=1024, target_s=0.1, decode_ratio=2.5)
    _device(slow, 0.4, 0.01, [8, 200, 8, 300])
    assert slow.tokens(8) in (79, 80)  # (2.5 * (0.4 + 0.01 * 8) - 0.4) / 0.01, rounded down
    assert slow.tokens(0) == MIN_STEP_TOKENS  # nothing decodes: the target alone
    fast = StepBudget(max_tokens=1024, target_s=0.25, decode_ratio=2.5)
    _device(fast, 0.010, 0.001, [8, 200, 8, 8, 200, 9])
    assert fast.tokens(8) in (34, 35)  # (2.5 * (0.010 + 0.001 * 8) - 0.010) / 0.001
    assert abs(fast.tokens(0) - 240) <= 1
    target_alone = StepBudget(max_tokens=1024, target_s=0.1)
    _device(target_alone, 0.4, 0.01, [8, 200, 8, 300])
    assert target_alone.tokens(8) == MIN_STEP_TOKENS


def test_no_target_is_the_fixed_budget() -> None:
    budget = StepBudget(max_tokens=1024, target_s=0.0)
    _device(budget, 5.0, 0.1, [8, 200])
    assert budget.tokens(0) == 1024
