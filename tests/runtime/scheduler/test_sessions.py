"""Program sessions: a session's last finished sequence stays pinned in the radix tree between its
calls, is replaced by the next one, is released by close or timeout, gives way under memory pressure
(never deadlocking admission) and puts its waiting requests first."""

from __future__ import annotations

from pathlib import Path

import pytest
from scheduler_helpers import make_req, message

import radixlm_runtime as rt
from radixlm_runtime.io.messages import GenerateReq
from radixlm_runtime.kvcache.allocator import RowAllocator, TokenAllocator
from radixlm_runtime.kvcache.radix_cache import RadixCache
from radixlm_runtime.scheduler.cache import CacheManager
from radixlm_runtime.scheduler.policy import SchedulePolicy
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.scheduler.session import MAX_SESSION_ID_LEN, SessionTable, check_session_id

TIMEOUT_S = 60.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cache(size: int = 128, disable: bool = False, max_pinned: int = 0) -> tuple[CacheManager, FakeClock]:
    cm = CacheManager(TokenAllocator(size), RowAllocator(8), disable)
    clock = FakeClock()
    cm.sessions = SessionTable(cm.tree, TIMEOUT_S, max_pinned, clock)
    return cm, clock


def _serve(cm: CacheManager, rid: str, prompt: list[int], output: list[int], sid: str | None) -> Req:
    """Runs a request through the cache the way the scheduler does: open its session, admit it on
    its cached prefix, compute the KV of prompt + output, finish."""
    req = make_req(rid, prompt, session_id=sid)
    if sid is not None:
        cm.sessions.open(sid, rid)
    if cm.tree is not None:
        req.prefix_len, req.last_node = cm.tree.match_node(req.token_ids)
    assert cm.admit(req)
    req.token_ids.extend(output)
    n = len(req.token_ids) - req.kv_len
    slots = cm.alloc_slots(n)
    assert slots is not None
    req.kv_slots.extend(slots)
    req.kv_len += n
    cm.finish(req)
    return req


def _cached_len(cm: CacheManager, ids: list[int]) -> int:
    return len(cm.tree.match_prefix(ids)[0])


def _assert_accounting(cm: CacheManager) -> None:
    tree = cm.tree
    held = tree.total_size() if tree is not None else 0
    assert cm.allocator.available_size() + held == cm.allocator.size


def _seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_pin_survives_eviction_pressure() -> None:
    cm, _ = _cache()
    history = _seq(1, 30) + _seq(100, 10)
    _serve(cm, "p1", _seq(1, 30), _seq(100, 10), sid="prog")
    _serve(cm, "other", _seq(200, 30), _seq(300, 5), sid=None)
    assert cm.sessions.pinned_tokens() == len(history)
    # Ask for every slot there is: only unpinned KV can go.
    assert cm.alloc_slots(cm.available_tokens()) is not None
    assert _cached_len(cm, history) == len(history)
    assert _cached_len(cm, _seq(200, 35)) == 0
    assert cm.tree.protected_size() == len(history)


def test_new_pin_replaces_and_unlocks_the_old_one() -> None:
    cm, _ = _cache()
    first = _seq(1, 20) + _seq(50, 5)
    _serve(cm, "c1", _seq(1, 20), _seq(50, 5), sid="prog")
    # The next call extends the history: one pin on the longer path.
    second = first + _seq(60, 10)
    _serve(cm, "c2", first + _seq(60, 6), _seq(66, 4), sid="prog")
    assert cm.tree.protected_size() == cm.sessions.pinned_tokens() == len(second)
    # A call that diverges after 10 tokens: the old path's tail becomes evictable.
    third = _seq(1, 10) + _seq(90, 8)
    _serve(cm, "c3", _seq(1, 10) + _seq(90, 5), _seq(95, 3), sid="prog")
    assert cm.tree.protected_size() == cm.sessions.pinned_tokens() == len(third)
    cm.tree.evict(10_000)
    assert _cached_len(cm, third) == len(third)
    assert _cached_len(cm, second) == 10
    _assert_accounting(cm)


def test_sessions_share_a_prefix_counted_once() -> None:
    cm, _ = _cache()
    system = _seq(1, 20)
    _serve(cm, "a", system + [100, 101], [102], sid="a")
    _serve(cm, "b", system + [110, 111], [112], sid="b")
    assert cm.sessions.pinned_tokens() == cm.tree.protected_size() == 20 + 3 + 3


def test_close_releases_the_pin() -> None:
    cm, _ = _cache()
    _serve(cm, "r", _seq(1, 12), _seq(20, 4), sid="prog")
    assert len(cm.sessions) == 1 and cm.tree.protected_size() == 16
    assert cm.sessions.close("prog") is True
    assert len(cm.sessions) == 0
    assert cm.tree.protected_size() == 0 and cm.sessions.pinned_tokens() == 0
    assert cm.sessions.close("prog") is False
    assert cm.tree.evict(10_000) == 16
    _assert_accounting(cm)


def test_closed_while_running_pins_nothing() -> None:
    cm, _ = _cache()
    req = make_req("r", _seq(1, 10), session_id="prog")
    cm.sessions.open("prog", "r")
    assert cm.admit(req)
    slots = cm.alloc_slots(10)
    assert slots is not None
    req.kv_slots.extend(slots)
    req.kv_len = 10
    assert cm.sessions.close("prog") is True
    cm.finish(req)
    assert len(cm.sessions) == 0 and cm.tree.protected_size() == 0
    _assert_accounting(cm)


def test_idle_timeout_releases_but_in_flight_sessions_never_expire() -> None:
    cm, clock = _cache()
    _serve(cm, "r1", _seq(1, 10), [50], sid="idle")
    cm.sessions.open("busy", "r2")  # a request in flight (queued) for a long time
    clock.now = TIMEOUT_S - 1
    assert len(cm.sessions) == 2 and cm.sessions.pinned_tokens() == 11
    clock.now = TIMEOUT_S + 1
    assert len(cm.sessions) == 1 and cm.sessions.is_open("busy")
    assert cm.sessions.pinned_tokens() == 0 and cm.tree.protected_size() == 0
    # Activity resets the clock: a session used again at t=61 lives until t=121.
    _serve(cm, "r3", _seq(1, 10), [50], sid="idle")
    clock.now = 2 * TIMEOUT_S
    assert cm.sessions.is_open("idle")
    clock.now = 2 * TIMEOUT_S + 2
    assert not cm.sessions.is_open("idle")


def test_idle_pins_give_way_lru_first_active_ones_only_when_stalled() -> None:
    cm, clock = _cache(size=256)
    for i, sid in enumerate(["a", "c", "b"]):
        clock.now = float(i)
        _serve(cm, sid, _seq(10 * i + 1, 5), [200 + i], sid=sid)
    clock.now = 3.0
    _serve(cm, "d", _seq(100, 5), [210], sid="d")
    cm.sessions.open("d", "d2")  # d has a request waiting: not idle
    cm.sessions.open("e", "e1")  # e is open but has no pin yet
    order = []
    while cm.sessions.give_way(stalled=False):
        order.append(sorted(cm.sessions.pinned_ids()))
    assert order == [["b", "c", "d"], ["b", "d"], ["d"]]
    assert cm.sessions.give_way(stalled=True) is True
    assert not cm.sessions.pinned_ids() and cm.tree.protected_size() == 0
    assert cm.sessions.give_way(stalled=True) is False
    assert len(cm.sessions) == 5


def test_idle_pins_within_their_share_stay_unless_stalled() -> None:
    cm, clock = _cache(size=256, max_pinned=20)
    for i, sid in enumerate(["old", "new"]):
        clock.now = float(i)
        _serve(cm, sid, _seq(20 * i + 1, 14), [200 + i], sid=sid)
    assert cm.sessions.pinned_tokens() == 30
    assert cm.sessions.give_way(stalled=False) is True
    assert set(cm.sessions.pinned_ids()) == {"new"}
    # 15 pinned tokens are within the 20-token share: they stay, unless nothing else can run.
    assert cm.sessions.give_way(stalled=False) is False
    assert cm.sessions.give_way(stalled=True) is True and not cm.sessions.pinned_ids()


def test_stalled_give_way_spares_the_admitted_requests_own_session_last() -> None:
    cm, clock = _cache(size=256)
    for i, sid in enumerate(["old", "new"]):
        clock.now = float(i)
        _serve(cm, sid, _seq(10 * i + 1, 5), [200 + i], sid=sid)
        cm.sessions.open(sid, f"{sid}-next")
    assert cm.sessions.give_way(stalled=False) is False
    assert cm.sessions.give_way(stalled=True, spare="old")
    assert set(cm.sessions.pinned_ids()) == {"old"}


def test_flush_drops_pins_and_keeps_sessions() -> None:
    cm, _ = _cache()
    _serve(cm, "r", _seq(1, 12), [30], sid="prog")
    assert cm.flush()
    assert cm.tree.total_size() == 0 and cm.sessions.pinned_tokens() == 0
    assert cm.sessions.is_open("prog")
    _assert_accounting(cm)


def test_disabled_radix_cache_tracks_sessions_without_pins() -> None:
    cm, _ = _cache(disable=True)
    _serve(cm, "r", _seq(1, 12), [30], sid="prog")
    assert len(cm.sessions) == 1 and cm.sessions.pinned_tokens() == 0
    assert cm.allocator.available_size() == cm.allocator.size
    assert cm.sessions.close("prog")


def test_policy_admits_pinned_sessions_first() -> None:
    alloc = TokenAllocator(64)
    tree = RadixCache(alloc)
    tree.insert(_seq(1, 8), alloc.alloc(8))
    waiting = [
        make_req("long-match", _seq(1, 8) + [40]),
        make_req("new-session", [9, 9, 9], session_id="fresh"),
        make_req("program", [7, 7], session_id="running"),
        make_req("short-match", _seq(1, 3) + [41]),
        make_req("program-2", _seq(1, 4) + [42], session_id="running"),
    ]
    policy = SchedulePolicy("lpm", tree)
    assert [r.rid for r in policy.order(waiting)] == [
        "long-match",
        "program-2",
        "short-match",
        "new-session",
        "program",
    ]
    # Requests of a session with pinned KV first, each group in LPM order.
    assert [r.rid for r in policy.order(waiting, {"running"})] == [
        "program-2",
        "program",
        "long-match",
        "short-match",
        "new-session",
    ]
    fcfs = SchedulePolicy("fcfs", tree).order(waiting, {"running"})
    assert [r.rid for r in fcfs][:2] == ["program", "program-2"]


@pytest.mark.parametrize("bad", ["", "x" * (MAX_SESSION_ID_LEN + 1), "a\nb", 7, None])
def test_session_id_validation(bad: object) -> None:
    with pytest.raises(ValueError, match="session_id"):
        check_session_id(bad)


# -- the scheduler on the tiny random-init model ---------------------------------------------------
GREEDY = {"temperature": 0, "ignore_eos": True}


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 250 + 3 for j in range(n)]


def _run(engine: rt.Engine, msgs: list[GenerateReq], max_steps: int = 2000) -> list[Req]:
    sched = engine.scheduler
    reqs = [sched.submit(m) for m in msgs]
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < max_steps, f"no progress: {engine.get_server_info()}"
    assert all(r.finished for r in reqs)
    return reqs


def _req(rid: str, ids: list[int], max_new: int, sid: str | None) -> GenerateReq:
    return message(rid, ids, GREEDY | {"max_new_tokens": max_new}, session_id=sid)


def _program_after_other_traffic(engine: rt.Engine, sid: str | None) -> tuple[int, list[int]]:
    """A two-call program with unrelated traffic in between that needs most of the pool; returns
    the second call's cached tokens and the history the first call computed."""
    prompt = _ids(1, 60)
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY | {"max_new_tokens": 20}, session_id=sid)
    history = prompt + first["output_ids"]
    engine.generate(input_ids=[_ids(k, 100) for k in (2, 3)], sampling_params=GREEDY | {"max_new_tokens": 10})
    second = engine.generate(
        input_ids=history + _ids(4, 5), sampling_params=GREEDY | {"max_new_tokens": 5}, session_id=sid
    )
    return second["meta_info"]["cached_tokens"], history


def test_pinned_history_is_rehit_after_other_traffic(tiny_llama_dir: Path) -> None:
    engine = rt.Engine(str(tiny_llama_dir), max_total_tokens=256, log_level="warning")
    cached, history = _program_after_other_traffic(engine, "p")
    # Everything the first call computed (all but its last sampled token) is a cache hit.
    assert cached == len(history) - 1
    info = engine.get_server_info()
    assert info["num_sessions"] == 1 and info["pinned_tokens"] == len(history) + 5 + 4
    assert engine.close_session("p") and not engine.close_session("p")
    info = engine.get_server_info()
    assert info["num_sessions"] == 0 and info["pinned_tokens"] == 0 and info["protected_tokens"] == 0
    cache = engine.scheduler.cache
    assert cache.allocator.available_size() + info["cached_tokens_in_tree"] == info["max_total_tokens"]
    # The same program without a session loses its history to the other traffic.
    control = rt.Engine(str(tiny_llama_dir), max_total_tokens=256, log_level="warning")
    assert _program_after_other_traffic(control, None)[0] < len(history) - 1


def test_pins_give_way_instead_of_deadlocking(tiny_llama_dir: Path) -> None:
    """Two programs each pin ~40% of a 128-token pool, then both send a next call needing more than
    what is free: each call waits on the other's pin, and neither program is idle. The last resort
    (nothing running) unpins one, both calls finish."""
    engine = rt.Engine(str(tiny_llama_dir), max_total_tokens=128, log_level="warning")
    a1, b1 = _run(engine, [_req("a1", _ids(1, 40), 10, "A"), _req("b1", _ids(2, 40), 10, "B")])
    assert engine.get_server_info()["pinned_tokens"] == 2 * 49
    a2_msg = _req("a2", a1.token_ids + _ids(3, 20), 20, "A")
    a2, b2 = _run(engine, [a2_msg, _req("b2", b1.token_ids + _ids(4, 20), 20, "B")])
    assert a2.output_len == b2.output_len == 20
    # A third program's call does not fit beside the idle pins: the least recently used goes.
    _run(engine, [_req("c1", _ids(5, 80), 8, "C")])
    assert engine.scheduler.cache.sessions.pinned_ids() == {"C"}
    for sid in ("A", "B", "C"):
        engine.close_session(sid)
    info = engine.get_server_info()
    assert info["protected_tokens"] == 0 and info["num_sessions"] == 0


def test_waiting_program_call_runs_before_new_work(tiny_llama_dir: Path) -> None:
    engine = rt.Engine(
        str(tiny_llama_dir), max_total_tokens=2048, max_running_requests=1, log_level="warning"
    )
    sched = engine.scheduler
    prompt = _ids(1, 30)
    (first,) = _run(engine, [_req("p1", prompt, 4, "prog")])
    # A request with a longer cached prefix (LPM would pick it) and then the program's next call.
    other = sched.submit(_req("x", first.token_ids + _ids(2, 40), 4, None))
    nxt = sched.submit(_req("p2", prompt + _ids(3, 4), 4, "prog"))
    sched.step()
    assert nxt.first_scheduled_time is not None and other.first_scheduled_time is None
    _run(engine, [])
    engine.close_session("prog")
    assert engine.get_server_info()["protected_tokens"] == 0
