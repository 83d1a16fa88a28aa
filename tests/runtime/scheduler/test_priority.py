"""Request priorities: higher levels are admitted first, the schedule policy orders equal levels,
and waiting ages a request up so a stream of important work never starves the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
from scheduler_helpers import assert_no_leak, make_req

import radixlm_runtime as rt
from radixlm_runtime.io.messages import sample_request
from radixlm_runtime.kvcache.allocator import TokenAllocator
from radixlm_runtime.kvcache.radix_cache import RadixCache
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.scheduler.policy import PriorityRule, SchedulePolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _req(rid: str, ids: list[int], priority: int, arrival: float = 0.0):
    req = make_req(rid, ids, priority=priority)
    req.arrival_time = arrival
    return req


def test_higher_priority_first_and_lpm_within_a_level() -> None:
    alloc = TokenAllocator(64)
    tree = RadixCache(alloc)
    tree.insert([1, 2, 3, 4], alloc.alloc(4))
    clock = Clock()
    waiting = [
        _req("low-cached", [1, 2, 3, 4, 9], 0),
        _req("high-a", [7, 7, 7], 5),
        _req("high-cached", [1, 2, 3, 8], 5),
        _req("mid", [6, 6], 1),
    ]
    policy = SchedulePolicy("lpm", tree, PriorityRule(clock=clock))
    assert [r.rid for r in policy.order(waiting)] == ["high-cached", "high-a", "mid", "low-cached"]
    low_first = SchedulePolicy("fcfs", tree, PriorityRule(low_values_first=True, clock=clock))
    assert [r.rid for r in low_first.order(waiting)] == ["low-cached", "mid", "high-a", "high-cached"]


def test_waiting_ages_a_request_past_newer_important_ones() -> None:
    clock = Clock()
    policy = SchedulePolicy("fcfs", None, PriorityRule(aging_s=10.0, clock=clock))
    old = _req("old-low", [1], 0, arrival=0.0)
    clock.now = 25.0  # the low-priority request has waited two levels' worth
    fresh = [_req(f"new-{p}", [2], p, arrival=25.0) for p in (1, 2, 3)]
    assert [r.rid for r in policy.order([*fresh, old])] == ["new-3", "new-2", "old-low", "new-1"]


def test_without_priority_scheduling_priorities_are_ignored() -> None:
    waiting = [_req("a", [1], 0), _req("b", [2], 9)]
    assert [r.rid for r in SchedulePolicy("fcfs", None).order(waiting)] == ["a", "b"]


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, 1.5, "high", True])
def test_priority_must_be_a_bounded_integer(tiny_llama_dir: Path, bad: object) -> None:
    engine = rt.Engine(str(tiny_llama_dir), max_total_tokens=1024, log_level="warning")
    with pytest.raises(ValueError, match="priority"):
        engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1}, priority=bad)


def test_engine_admits_by_priority(tiny_llama_dir: Path) -> None:
    """One request runs at a time: the important prompts finish first though submitted last."""
    engine = rt.Engine(
        str(tiny_llama_dir),
        max_total_tokens=2048,
        max_running_requests=1,
        enable_priority_scheduling=True,
        log_level="warning",
    )
    order: list[str] = []
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    for i, prio in enumerate([0, 0, 3, 7]):
        sched.submit(sample_request(f"p{i}", 0, [10 + i, 11, 12], params, priority=prio))
    while sched.has_work():
        order += [o.rid for o in sched.step() if o.finished_reason is not None]
    assert order == ["p3", "p2", "p0", "p1"]
    assert_no_leak(engine)
