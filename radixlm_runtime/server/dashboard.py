"""The live dashboard: /dashboard (a static page shipped in the package) and the bounded JSON feeds
under /dashboard/api/ that it reads: the radix tree, requests, program sessions and metrics over time.

The page and its files are public so a browser can load them; it shows nothing until it is given the
API key, which it sends as a Bearer header to the feeds (every feed needs it, like any endpoint). The
page runs no inline script and writes data only as text: the Content-Security-Policy below forbids
inline script, so a prompt's text could not run even if it reached the markup.

Snapshots come from the scheduler process between steps (server/dashboard_snapshot.py). Identical
feed requests within SNAPSHOT_TTL_S share one scheduler call, so any number of open pages costs the
scheduler at most one snapshot of each kind per TTL; metrics are sampled once a second whatever
reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Query
from fastapi.responses import Response

from radixlm_runtime.io import messages as msg
from radixlm_runtime.server.errors import RequestError
from radixlm_runtime.server.tokenizer_manager import TokenizerManager
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

STATIC_DIR = Path(__file__).parent / "static" / "dashboard"
STATIC_PREFIX = "/dashboard/static/"
# Every file the page is made of, by URL path; nothing else under the prefix is served.
ASSETS: dict[str, Path] = {
    STATIC_PREFIX + p.relative_to(STATIC_DIR).as_posix(): p
    for p in sorted(STATIC_DIR.rglob("*"))
    if p.is_file() and (p.suffix in {".js", ".css", ".svg", ".txt"} or p.name == "LICENSE")
}
# Paths a browser loads without the API key: the page shell, its files and whether it needs the key
# (so the page asks for it before any refused request); never data.
PUBLIC_PATHS = frozenset({"/dashboard", "/dashboard/auth", *ASSETS})
MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml", ".html": "text/html"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

# Snapshots of the same kind and bounds asked within this long share one scheduler call; one that
# took the scheduler d seconds to build is shared for COST_FACTOR * d seconds when that is longer,
# so snapshots take at most 1 / COST_FACTOR of the scheduler's time however many pages poll.
SNAPSHOT_TTL_S = 0.5
COST_FACTOR = 100
# Metrics sampling: one sample a second, an hour of them.
SAMPLE_INTERVAL_S = 1.0
SAMPLES_KEPT = 3600
# Feed bounds (the scheduler side clamps again).
MAX_TREE_NODES = 20_000
DEFAULT_TREE_NODES = 2000
MAX_TREE_DEPTH = 256
PREVIEW_TOKENS = 24
PREVIEW_CHARS = 160
SEARCH_TOKENS = 512
MAX_QUERY_CHARS = 200
MAX_RECENT = 1000
PROMPT_TOKENS = 4096
LIST_PREVIEW_TOKENS = 48
MAX_SESSIONS = 100
# Decoded node texts remembered by their token ids (a poll decodes only nodes it has not seen).
TEXT_CACHE_ENTRIES = 50_000


class SnapshotCache:
    """Coalesces identical scheduler calls: one in flight per key, its answer reused while fresh
    (ttl_s, or COST_FACTOR times the scheduler time it took to build, whichever is longer)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[tuple[Any, ...], tuple[float, asyncio.Future[dict[str, Any]]]] = {}

    def _fresh(self, entry: tuple[float, asyncio.Future[dict[str, Any]]], now: float) -> bool:
        started, fut = entry
        if not fut.done():
            return True
        if fut.cancelled() or fut.exception() is not None:
            return False
        return now - started <= max(self.ttl_s, COST_FACTOR * fut.result().get("build_s", 0.0))

    async def get(
        self, key: tuple[Any, ...], fetch: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        now = time.monotonic()
        entry = self._entries.get(key)
        if entry is None or not self._fresh(entry, now):
            self._entries = {k: e for k, e in self._entries.items() if self._fresh(e, now)}
            entry = (now, asyncio.ensure_future(fetch()))
            self._entries[key] = entry
        return await asyncio.shield(entry[1])


class MetricsHistory:
    """One sample of the scheduler's counters and gauges a second, the last hour of them."""

    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm
        self.samples: deque[dict[str, Any]] = deque(maxlen=SAMPLES_KEPT)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(RequestError):
                self.samples.append(_sample(await self.tm.server_info(), len(self.tm.states)))
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def since(self, t: float) -> list[dict[str, Any]]:
        return [s for s in self.samples if s["t"] > t]


def _sample(info: dict[str, Any], inflight: int) -> dict[str, Any]:
    """Cumulative counters (the page differentiates them over its window) and current gauges."""
    keys = (
        "generated_tokens",
        "prompt_tokens",
        "cached_tokens",
        "finished_requests",
        "num_running",
        "num_waiting",
        "num_compiling",
        "free_tokens",
        "cached_tokens_in_tree",
        "protected_tokens",
        "max_total_tokens",
    )
    return {"t": round(time.time(), 3), "inflight": inflight, **{k: info.get(k, 0) for k in keys}}


class Dashboard:
    """The feeds' logic: asks the scheduler for snapshots and turns token ids into text (on a worker
    thread: decoding thousands of previews would stall the event loop)."""

    def __init__(self, tm: TokenizerManager, model_name: str) -> None:
        self.tm = tm
        self.model_name = model_name
        self.redact = tm.args.server.dashboard_redact
        self.cache = SnapshotCache(SNAPSHOT_TTL_S)
        self.metrics = MetricsHistory(tm)
        self._texts: dict[tuple[int, ...], str] = {}

    async def snapshot(self, view: str, **bounds: Any) -> dict[str, Any]:
        if self.redact:
            bounds["text_tokens"] = 0

        async def fetch() -> dict[str, Any]:
            result = await self.tm.call(lambda i: msg.DashboardReq(i, view, **bounds))  # type: ignore[arg-type]
            if not result.ok:
                raise RequestError(str(result.info.get("error", "dashboard snapshot failed")), status=404)
            return result.info

        return await self.cache.get((view, *sorted(bounds.items())), fetch)

    def text(self, ids: list[int], limit: int | None = None) -> str | None:
        """Decoded text (special tokens shown), None when redacted."""
        if self.redact:
            return None
        text = self.tm.tokenizer.decode(ids, skip_special_tokens=False)
        return text if limit is None else _clip(text, limit)

    def node_text(self, ids: list[int]) -> str | None:
        """text(ids), remembered: the tree's nodes change little from one poll to the next."""
        key = tuple(ids)
        text = self._texts.get(key)
        if text is None and not self.redact:
            if len(self._texts) >= TEXT_CACHE_ENTRIES:
                self._texts.clear()
            text = self._texts[key] = self.text(ids)  # type: ignore[assignment]
        return text

    # -- feeds -----------------------------------------------------------------------------------
    async def overview(self) -> dict[str, Any]:
        info = await self.tm.server_info()
        return {
            "model": self.model_name,
            "redact": self.redact,
            "api_key_required": self.tm.args.server.api_key is not None,
            "info": info,
            "num_inflight_requests": len(self.tm.states),
        }

    async def tree(self, max_nodes: int, max_depth: int, query: str | None) -> dict[str, Any]:
        if query is not None and self.redact:
            raise RequestError("text search is off: the server runs with --dashboard-redact", param="q")
        tokens = SEARCH_TOKENS if query else PREVIEW_TOKENS
        snap = await self.snapshot("tree", max_nodes=max_nodes, max_depth=max_depth, text_tokens=tokens)
        return await self.tm.run_cpu(self._shape_tree, snap, query)

    def _shape_tree(self, snap: dict[str, Any], query: str | None) -> dict[str, Any]:
        """The scheduler's node columns as one row per node, with their text."""
        needle = query.casefold() if query else None
        cols, names = snap["nodes"], snap.get("locked_by", {})
        nodes = []
        for i in range(len(cols["id"])):
            values = {field: column[i] for field, column in cols.items()}
            full = self.node_text(values["ids"])
            row = _node_row(
                values, names.get(values["id"], []), None if full is None else _clip(full, PREVIEW_CHARS)
            )
            if needle is not None:
                row["match"] = full is not None and needle in full.casefold()
            nodes.append(row)
        return _without(snap, "locked_by") | {"nodes": nodes, "query": query}

    async def node(self, node_id: int) -> dict[str, Any]:
        snap = await self.snapshot("node", node_id=node_id, text_tokens=PROMPT_TOKENS, max_recent=200)
        if snap["node"] is None:
            raise RequestError(f"no node {node_id} in the radix tree (evicted or split?)", status=404)
        return await self.tm.run_cpu(self._shape_node, snap)

    def _shape_node(self, snap: dict[str, Any]) -> dict[str, Any]:
        raw = snap["node"]
        node = _node_row(_without(raw, "prefix_ids", "locked_by"), raw["locked_by"], self.text(raw["ids"]))
        node["prefix_text"] = self.text(raw["prefix_ids"])
        return {"node": node, "requests": [self._shape_request(r) for r in snap["requests"]]}

    async def requests(self, max_recent: int) -> dict[str, Any]:
        snap = await self.snapshot("requests", max_recent=max_recent, text_tokens=LIST_PREVIEW_TOKENS)
        return await self.tm.run_cpu(self._shape_requests, snap)

    def _shape_requests(self, snap: dict[str, Any]) -> dict[str, Any]:
        return snap | {
            "live": [self._shape_request(r) for r in snap["live"]],
            "recent": [self._shape_request(r) for r in snap["recent"]],
        }

    async def request(self, rid: str) -> dict[str, Any]:
        snap = await self.snapshot("request", rid=rid, text_tokens=PROMPT_TOKENS)
        if snap["request"] is None:
            raise RequestError(f"no request {rid!r} is live or among the recent ones", status=404)
        return {"request": await self.tm.run_cpu(self._shape_request, snap["request"], True)}

    def _shape_request(self, r: dict[str, Any], split_cached: bool = False) -> dict[str, Any]:
        """A request with its prompt as text: whole (a preview), or split at its cached prefix."""
        ids, out_ids = r["prompt_ids"], r.get("output_ids")
        r = _without(r, "prompt_ids", "output_ids")
        if split_cached:
            cut = min(r["cached_tokens"], len(ids))
            r["cached_text"], r["uncached_text"] = self.text(ids[:cut]), self.text(ids[cut:])
            r["prompt_shown_tokens"] = len(ids)
        else:
            r["preview"] = self.text(ids, PREVIEW_CHARS)
        if out_ids is not None:
            r["output_text"] = self.text(out_ids)
        return r

    async def programs(self) -> dict[str, Any]:
        """Runs of @function programs, calls in order: by the run the frontend named (its call
        graph: each call's parent, forks included), else by session_id (one stream of calls)."""
        snap = await self.snapshot("requests", max_recent=MAX_RECENT, text_tokens=0)
        runs: dict[str, dict[str, Any]] = {}
        pinned = set(snap["pinned_sessions"])
        for r in sorted([*snap["live"], *snap["recent"]], key=lambda r: r["arrival"]):
            call = r["program_call"]
            key = call["run"] if call is not None else r["session_id"]
            if key is None:
                continue
            new = {"session_id": key, "program": _program_name(key), "pinned": False, "call_graph": False}
            run = runs.setdefault(key, new | {"calls": []})
            run["pinned"] = run["pinned"] or r["session_id"] in pinned
            run["call_graph"] = run["call_graph"] or call is not None
            run["calls"].append(_without(r, "prompt_ids"))
        listed = sorted(runs.values(), key=lambda s: -s["calls"][-1]["arrival"])[:MAX_SESSIONS]
        for s in listed:
            calls = s["calls"]
            s["prompt_tokens"] = sum(c["prompt_tokens"] for c in calls)
            s["cached_tokens"] = sum(c["cached_tokens"] for c in calls)
        return {"sessions": listed}


def _node_row(values: dict[str, Any], locked_by: list[str], text: str | None) -> dict[str, Any]:
    """One node as the feeds show it (the README's API section lists the fields)."""
    root = values["parent"] == -1
    return _without(values, "ids") | {
        "parent": None if root else values["parent"],
        "locked_by": locked_by,
        # Locks beyond the running requests named: more requests, and session pins.
        "other_locks": max(values["lock_ref"] - len(locked_by), 0),
        "evictable": not root and values["lock_ref"] == 0,
        "text": text,
    }


def _without(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    """A copy of d without keys: snapshots are shared by every reader within their TTL, so shaping
    one for a response never changes it."""
    return {k: v for k, v in d.items() if k not in keys}


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _program_name(session_id: str) -> str:
    """The frontend names a run's session '<function>-<16 hex>' (interpreter.py)."""
    head, _, tail = session_id.rpartition("-")
    return head if head and len(tail) >= 8 else session_id


def _json(payload: Any) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json", headers=SECURITY_HEADERS)


def _asset(path: Path) -> Response:
    media = MEDIA_TYPES.get(path.suffix, "text/plain; charset=utf-8")
    return Response(path.read_bytes(), media_type=media, headers=SECURITY_HEADERS)


def mount_dashboard(app: FastAPI, tm: TokenizerManager, model_name: str) -> None:
    """Adds the page and its feeds to app (nothing with --disable-dashboard), and runs the metrics
    sampler for the app's lifetime."""
    if tm.args.server.disable_dashboard:
        return
    dash = Dashboard(tm, model_name)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        dash.metrics.start()
        try:
            async with inner(a) as state:
                yield state
        finally:
            dash.metrics.stop()

    app.router.lifespan_context = lifespan

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        return _asset(STATIC_DIR / "index.html")

    @app.get("/dashboard/auth", include_in_schema=False)
    async def auth() -> Response:
        return _json({"api_key_required": tm.args.server.api_key is not None})

    @app.get(STATIC_PREFIX + "{path:path}", include_in_schema=False)
    async def asset(path: str) -> Response:
        file = ASSETS.get(STATIC_PREFIX + path)
        if file is None:
            raise RequestError(f"no dashboard file {path!r}", status=404)
        return _asset(file)

    @app.get("/dashboard/api/overview")
    async def overview() -> Response:
        return _json(await dash.overview())

    @app.get("/dashboard/api/tree")
    async def tree(
        max_nodes: int = Query(DEFAULT_TREE_NODES, ge=1, le=MAX_TREE_NODES),
        max_depth: int = Query(64, ge=0, le=MAX_TREE_DEPTH),
        q: str | None = Query(None, min_length=1, max_length=MAX_QUERY_CHARS),
    ) -> Response:
        return _json(await dash.tree(max_nodes, max_depth, q))

    @app.get("/dashboard/api/node/{node_id}")
    async def node(node_id: int) -> Response:
        return _json(await dash.node(node_id))

    @app.get("/dashboard/api/requests")
    async def requests(max_recent: int = Query(100, ge=0, le=MAX_RECENT)) -> Response:
        return _json(await dash.requests(max_recent))

    @app.get("/dashboard/api/request/{rid}")
    async def request(rid: str) -> Response:
        if len(rid) > 256:
            raise RequestError("rid: at most 256 characters", param="rid")
        return _json(await dash.request(rid))

    @app.get("/dashboard/api/programs")
    async def programs() -> Response:
        return _json(await dash.programs())

    @app.get("/dashboard/api/metrics")
    async def metrics(since: float = Query(0.0, ge=0)) -> Response:
        return _json({"interval_s": SAMPLE_INTERVAL_S, "samples": dash.metrics.since(since)})
