"""The router's choices without servers: cache-aware routing keeps a prefix on one replica and spreads
new ones, load imbalance overrides the cache, round-robin and least-load, sticky sessions, health,
the bounded per-replica tree, and what text a request is routed on."""

from __future__ import annotations

import pytest

from radixlm_runtime.config import RouterConfig
from radixlm_runtime.router.app import routing_text
from radixlm_runtime.router.policy import NoReplica, Router

URLS = ("http://127.0.0.1:1", "http://127.0.0.1:2")
PREFIX_A = "You are tenant A's assistant. " * 8
PREFIX_B = "Tenant B answers in French only. " * 8


def router(**kw: object) -> Router:
    return Router(RouterConfig(worker_urls=URLS, **kw))  # type: ignore[arg-type]


def test_cache_aware_keeps_a_prefix_on_its_replica_and_spreads_new_ones() -> None:
    r = router()
    first_a = r.choose(PREFIX_A + "question 1")
    first_b = r.choose(PREFIX_B + "question 1")
    assert first_a is not first_b  # nobody held B: it went where the tree had most room
    for i in range(2, 8):
        assert r.choose(PREFIX_A + f"question {i}") is first_a
        assert r.choose(PREFIX_B + f"question {i}") is first_b
    assert first_a.matched_chars > 0.8 * first_a.chars - len(PREFIX_A)


def test_uneven_load_overrides_the_cache() -> None:
    r = router(balance_abs_threshold=2, balance_rel_threshold=1.5)
    home = r.choose(PREFIX_A + "q")
    for i in range(2):  # in flight, never done: home's load grows to 3, 2 ahead of the other
        assert r.choose(PREFIX_A + f"q{i}") is home
    other = r.choose(PREFIX_A + "q-late")  # 3 ahead: past both thresholds
    assert other is not home and home.in_flight == 3
    r.done(home)
    r.done(home)
    assert r.choose(PREFIX_A + "q0 again") is home  # within the thresholds: the longer match wins


def test_round_robin_and_least_load() -> None:
    rr = router(router_policy="round_robin")
    picks = [rr.choose(PREFIX_A).url for _ in range(4)]
    assert picks[0] != picks[1] and picks[0] == picks[2] and picks[1] == picks[3]
    ll = router(router_policy="least_load")
    busy = ll.choose("x")
    assert ll.choose("x") is not busy
    ll.done(busy)
    assert ll.replicas[0].in_flight + ll.replicas[1].in_flight == 1


def test_sessions_stick_to_their_replica_while_it_is_healthy() -> None:
    r = router(router_policy="round_robin")
    home = r.choose("turn 1", session_id="prog-1")
    assert all(r.choose(f"turn {i}", session_id="prog-1") is home for i in range(2, 6))
    home.healthy = False
    moved = r.choose("turn 6", session_id="prog-1")
    assert moved is not home and r.choose("turn 7", session_id="prog-1") is moved


def test_no_healthy_replica_is_an_error() -> None:
    r = router()
    for replica in r.replicas:
        replica.healthy = False
    with pytest.raises(NoReplica):
        r.choose("anything")


def test_the_tree_forgets_the_least_recently_matched_text() -> None:
    r = router(tree_chars=300)
    replica = r.replicas[0]
    replica.remember([ord(c) for c in PREFIX_A])
    assert replica.match([ord(c) for c in PREFIX_A]) == len(PREFIX_A)
    replica.remember([ord(c) for c in PREFIX_B])  # 264 + 264 chars > 300: A goes
    assert replica.match([ord(c) for c in PREFIX_B]) == len(PREFIX_B)
    assert replica.match([ord(c) for c in PREFIX_A]) < len(PREFIX_A)
    assert replica.tree.total_size() <= 300


def test_routing_text_per_api() -> None:
    assert routing_text("/generate", {"text": ["a", "b"]}) == "a"
    assert routing_text("/generate", {"input_ids": [1, 2, 3]}) == "1,2,3"
    assert routing_text("/v1/completions", {"prompt": "hello"}) == "hello"
    chat = routing_text("/v1/chat/completions", {"messages": [{"role": "system", "content": "S"}]})
    assert chat.startswith("system\n") and '"S"' in chat
    assert routing_text("/v1/chat/completions", {"messages": "nope"}) == ""


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"worker_urls": ()}, "worker_urls"),
        ({"worker_urls": ("localhost:1",)}, "worker_urls"),
        ({"worker_urls": URLS, "router_policy": "random"}, "router_policy"),
        ({"worker_urls": URLS, "cache_threshold": 2.0}, "cache_threshold"),
    ],
)
def test_config_is_validated(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kwargs)
