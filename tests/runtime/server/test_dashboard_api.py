"""The dashboard's feeds: per-node hit counts in the radix tree, the bounds of the tree and requests
snapshots (server/dashboard_snapshot.py, on a tree built here), and over HTTP on the shared server
the page's security headers, the API key on every feed, the query bounds, redaction and turning the
dashboard off."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from fastapi import FastAPI
from server_harness import HEADERS, Server, launch_server

from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.io.messages import DashboardReq, GenerateReq, ReqOutput
from radixlm_runtime.kvcache.allocator import TokenAllocator
from radixlm_runtime.kvcache.radix_cache import RadixCache
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.server import dashboard, dashboard_snapshot

FEEDS = ["overview", "tree", "requests", "programs", "metrics", "node/1", "request/x"]


# -- the radix tree's hit counter and the snapshots, without a server -----------------------------
def make_tree(keys: list[list[int]], host_tokens: int = 0, disk_tokens: int = 0) -> RadixCache:
    tree = RadixCache(
        TokenAllocator(10_000),
        TokenAllocator(host_tokens) if host_tokens else None,
        disk_allocator=TokenAllocator(disk_tokens) if disk_tokens else None,
    )
    for key in keys:
        slots = tree.allocator.alloc(len(key))
        assert slots is not None
        tree.insert(key, slots)
    return tree


def fake_scheduler(tree: RadixCache | None) -> Any:
    sessions = SimpleNamespace(pinned_ids=lambda: frozenset({"prog-0123456789abcdef"}))
    return SimpleNamespace(
        cache=SimpleNamespace(tree=tree, sessions=sessions),
        runner_info=SimpleNamespace(
            max_total_tokens=10_000,
            host_kv_tokens=tree.host_allocator.size if tree and tree.host_allocator else 0,
            disk_kv_tokens=tree.disk_allocator.size if tree and tree.disk_allocator else 0,
        ),
        constraints=[],
    )


def make_req(rid: str, ids: list[int], **kw: Any) -> Req:
    req = Req(GenerateReq(rid=rid, input_ids=ids, sampling_params=SamplingParams(max_new_tokens=8)), seed=0)
    for name, value in kw.items():
        setattr(req, name, value)
    return req


def test_hits_count_on_the_whole_path_and_survive_a_split() -> None:
    tree = make_tree([[1, 2, 3, 4, 5]])
    _, node = tree.match_node([1, 2, 3, 4, 5])
    tree.record_hit(node)
    tree.record_hit(node)
    # A match ending inside the edge splits it: the upper part keeps the hits that passed through it.
    _, upper = tree.match_node([1, 2, 9])
    tree.record_hit(upper)
    assert upper.key == [1, 2] and upper.hits == 3
    assert node.key == [3, 4, 5] and node.hits == 2
    assert tree.root_node.hits == 0


def test_tree_snapshot_is_bounded_in_nodes_and_depth() -> None:
    tree = make_tree([[i, 100 + i, 200 + i] for i in range(300)] + [[7, 107, 207, 300, 301]])
    sched, log = fake_scheduler(tree), dashboard_snapshot.RequestLog()
    snap = dashboard_snapshot.answer(sched, log, DashboardReq(0, "tree", max_nodes=50, text_tokens=2))
    cols = snap["nodes"]
    assert len(cols["id"]) == 50 and snap["truncated"]
    assert sum(cols["omitted_children"]) == 301 - 49
    assert all(len(ids) <= 2 for ids in cols["ids"])
    shallow = dashboard_snapshot.answer(sched, log, DashboardReq(0, "tree", max_nodes=10_000, max_depth=1))
    assert max(shallow["nodes"]["depth"]) == 1 and shallow["truncated"]
    full = dashboard_snapshot.answer(sched, log, DashboardReq(0, "tree", max_nodes=10**9, text_tokens=10**9))
    assert len(full["nodes"]["id"]) == 302 and not full["truncated"]
    assert full["total_tokens"] == 300 * 3 + 2
    redacted = dashboard_snapshot.answer(sched, log, DashboardReq(0, "tree", text_tokens=0))
    assert all(ids == [] for ids in redacted["nodes"]["ids"])


def test_tree_shows_each_nodes_tier() -> None:
    """A node evicted from the pool into the host tier shows as "host", one loaded back as both."""
    tree = make_tree([[1, 2, 3], [1, 2, 4]], host_tokens=100)
    _, older = tree.match_node([1, 2, 3])
    tree.match_node([1, 2, 4])  # [1, 2, 3] is now the least recently used leaf
    assert tree.evict(1) == 1
    sched, log = fake_scheduler(tree), dashboard_snapshot.RequestLog()
    snap = dashboard_snapshot.answer(sched, log, DashboardReq(0, "tree"))
    tiers = dict(zip(snap["nodes"]["id"], snap["nodes"]["tier"], strict=True))
    assert tiers[older.id] == "host" and list(tiers.values()).count("device") == 3  # root, [1 2], [4]
    assert snap["host_tokens"] == 1 and snap["host_tier_tokens"] == 100
    assert tree.load(older) == 1
    node = dashboard_snapshot.answer(sched, log, DashboardReq(0, "node", node_id=older.id))["node"]
    assert node["tier"] == "device+host"


def test_tree_shows_nodes_on_the_disk_tier() -> None:
    """A host tier of one token: the second node evicted from the pool pushes the first to disk."""
    tree = make_tree([[1, 2, 3], [1, 2, 4]], host_tokens=1, disk_tokens=100)
    _, older = tree.match_node([1, 2, 3])
    _, newer = tree.match_node([1, 2, 4])
    assert tree.evict(2) == 2
    sched, log = fake_scheduler(tree), dashboard_snapshot.RequestLog()
    snap = dashboard_snapshot.answer(sched, log, DashboardReq(0, "tree"))
    tiers = dict(zip(snap["nodes"]["id"], snap["nodes"]["tier"], strict=True))
    assert tiers[older.id] == "disk" and tiers[newer.id] == "host"
    assert snap["disk_tokens"] == 1 and snap["disk_tier_tokens"] == 100


def test_lock_holders_and_node_users() -> None:
    tree = make_tree([[1, 2, 3], [1, 2, 4]])
    sched, log = fake_scheduler(tree), dashboard_snapshot.RequestLog()
    _, shared = tree.match_node([1, 2])
    running = make_req("run-1", [1, 2, 3, 9])
    _, running.last_node = tree.match_node([1, 2, 3])
    running.req_pool_idx = 0
    tree.inc_lock_ref(running.last_node)
    log.submitted(running)
    log.submitted(make_req("wait-1", [5, 6]))
    done = make_req("done-1", [1, 2, 4], cached_tokens=2)
    log.submitted(done)
    done.finished_reason = FinishReason("length", length=8)
    log.ended([ReqOutput("done-1", [], done.finished_reason, 3, 0, 2)])
    snap = dashboard_snapshot.answer(sched, log, DashboardReq(0, "tree"))
    at = snap["nodes"]["id"].index(shared.id)
    assert snap["locked_by"][shared.id] == ["run-1"] and snap["nodes"]["lock_ref"][at] == 1
    assert snap["protected_tokens"] == 3
    users = dashboard_snapshot.answer(sched, log, DashboardReq(0, "node", node_id=shared.id))
    assert [(r["rid"], r["state"]) for r in users["requests"]] == [
        ("run-1", "running"),
        ("done-1", "finished"),
    ]
    reqs = dashboard_snapshot.answer(sched, log, DashboardReq(0, "requests", text_tokens=1))
    assert [(r["rid"], r["state"]) for r in reqs["live"]] == [("run-1", "running"), ("wait-1", "queued")]
    assert [r["prompt_ids"] for r in reqs["recent"]] == [[1]]
    assert reqs["recent"][0]["cached_tokens"] == 2 and reqs["recent"][0]["e2e"] is not None
    gone = dashboard_snapshot.answer(sched, log, DashboardReq(0, "node", node_id=10**9))
    assert gone["node"] is None


def test_recent_requests_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    log = dashboard_snapshot.RequestLog()
    for i in range(dashboard_snapshot.RECENT_KEPT + 5):
        req = make_req(f"r{i}", [1] * 10_000)
        log.submitted(req)
        req.finished_reason = FinishReason("length", length=8)
        log.ended([ReqOutput(req.rid, [], req.finished_reason, 10_000, 0, 0)])
    assert len(log.recent) == dashboard_snapshot.RECENT_KEPT and not log.live
    assert log.recent[0].rid == "r5"
    assert len(log.recent[-1].prompt_ids) == dashboard_snapshot.KEPT_PROMPT_TOKENS


def test_disabled_dashboard_mounts_nothing() -> None:
    app = FastAPI()
    tm = SimpleNamespace(args=SimpleNamespace(server=SimpleNamespace(disable_dashboard=True)))
    dashboard.mount_dashboard(app, tm, "m")  # type: ignore[arg-type]
    assert not [r for r in app.routes if getattr(r, "path", "").startswith("/dashboard")]


# -- over HTTP ------------------------------------------------------------------------------------
def get(server: Server, path: str, headers: dict[str, str] | None = HEADERS) -> requests.Response:
    return requests.get(f"{server.url}{path}", headers=headers, timeout=60)


def test_page_loads_without_key_and_feeds_need_it(server: Server) -> None:
    page = get(server, "/dashboard", headers=None)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "<script>" not in page.text  # no inline script: every script is a file
    for asset in dashboard.ASSETS:
        assert get(server, asset, headers=None).status_code == 200, asset
    assert get(server, "/dashboard/auth", headers=None).json() == {"api_key_required": True}
    for feed in FEEDS:
        assert get(server, f"/dashboard/api/{feed}", headers=None).status_code == 401, feed
        bad = get(server, f"/dashboard/api/{feed}", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401, feed
    assert get(server, "/dashboard/static/../../config.py", headers=None).status_code in (401, 404)
    assert get(server, "/dashboard/static/nope.js").status_code == 404


def test_feeds_with_key(server: Server) -> None:
    r = requests.post(
        f"{server.url}/generate",
        json={"text": "A radix tree shares prefixes.", "sampling_params": {"max_new_tokens": 2}},
        headers=HEADERS,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    rid = r.json()["meta_info"]["id"]
    # Back to back, within the snapshot TTL: both readers get the one shared snapshot, whole.
    again = [get(server, "/dashboard/api/tree?max_nodes=3") for _ in range(2)]
    assert [r.status_code for r in again] == [200, 200] and again[0].json() == again[1].json()
    tree = again[0].json()
    assert tree["enabled"] and 1 <= len(tree["nodes"]) <= 3
    assert any("radix" in (n["text"] or "") for n in get(server, "/dashboard/api/tree").json()["nodes"])
    found = get(server, "/dashboard/api/tree?q=radix%20tree").json()
    assert any(n["match"] for n in found["nodes"])
    recent = get(server, "/dashboard/api/requests").json()["recent"]
    assert any(x["rid"] == rid and "radix" in x["preview"] for x in recent)
    one = get(server, f"/dashboard/api/request/{rid}").json()["request"]
    assert (one["cached_text"] + one["uncached_text"]).startswith("A radix tree")
    assert get(server, "/dashboard/api/request/no-such-rid").status_code == 404
    assert "sessions" in get(server, "/dashboard/api/programs").json()
    assert get(server, "/dashboard/api/overview").json()["api_key_required"] is True


def test_requests_show_whether_they_stream(server: Server, client: Any, model: str) -> None:
    """Every entry point tells the scheduler whether the client reads the tokens as they come (the
    step budget paces prefill beside streamed decodes only), and the requests feed shows it."""
    sent = []  # one after another: the feed lists them last, newest first
    for stream in (False, True):
        body = {"text": "A radix tree", "sampling_params": {"max_new_tokens": 2}, "stream": stream}
        r = requests.post(f"{server.url}/generate", json=body, headers=HEADERS, timeout=120)
        assert r.status_code == 200, r.text
        sent.append(stream)
        out = client.completions.create(model=model, prompt="A radix tree", max_tokens=2, stream=stream)
        if stream:
            assert [c.choices[0].finish_reason for c in out][-1] == "length"
        sent.append(stream)
    time.sleep(dashboard.SNAPSHOT_TTL_S)  # past the snapshot an earlier test's read left
    recent = get(server, "/dashboard/api/requests").json()["recent"]
    assert [x["stream"] for x in recent[: len(sent)]] == sent[::-1]


@pytest.mark.parametrize(
    "query",
    ["max_nodes=0", f"max_nodes={dashboard.MAX_TREE_NODES + 1}", "max_depth=-1", "q=" + "x" * 201, "q="],
)
def test_tree_bounds_are_refused(server: Server, query: str) -> None:
    assert get(server, f"/dashboard/api/tree?{query}").status_code in (400, 422)


def test_requests_bounds_are_refused(server: Server) -> None:
    assert get(server, f"/dashboard/api/requests?max_recent={dashboard.MAX_RECENT + 1}").status_code in (
        400,
        422,
    )
    assert get(server, "/dashboard/api/request/" + "r" * 300).status_code == 400


@pytest.mark.slow
def test_redacted_dashboard_shows_no_text(tmp_path: Path) -> None:
    srv = launch_server(tmp_path, "--dashboard-redact", api_key=None)
    try:
        r = requests.post(
            f"{srv.url}/generate",
            json={"text": "my secret prompt", "sampling_params": {"max_new_tokens": 2}},
            timeout=120,
        )
        rid = r.json()["meta_info"]["id"]
        assert get(srv, "/dashboard/auth", headers=None).json() == {"api_key_required": False}
        tree = get(srv, "/dashboard/api/tree", headers=None)
        assert "secret" not in tree.text and all(n["text"] is None for n in tree.json()["nodes"][1:])
        reqs = get(srv, "/dashboard/api/requests", headers=None)
        assert "secret" not in reqs.text and reqs.json()["recent"][0]["preview"] is None
        one = get(srv, f"/dashboard/api/request/{rid}", headers=None)
        assert "secret" not in one.text and one.json()["request"]["cached_text"] is None
        assert get(srv, "/dashboard/api/tree?q=secret", headers=None).status_code == 400
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
