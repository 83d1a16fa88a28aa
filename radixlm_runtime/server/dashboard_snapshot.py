"""The scheduler process's side of the dashboard: bounded snapshots of the radix tree and of live and
recent requests, answered between steps (a DashboardReq), plus the log of requests that feeds them.

Everything here is plain data read from the scheduler's own objects; nothing runs per token. The log
keeps a reference to each live request (one dict insert at submit) and a compact record of each
finished one (one pop per finished request), so the cost to a step is a check per reported output.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from radixlm_runtime.io.messages import DashboardReq, ReqOutput
from radixlm_runtime.kvcache.radix_cache import RadixCache, TreeNode
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.scheduler.scheduler import Scheduler

# Bounds on what any snapshot may ask for, whatever the caller sends.
MAX_NODES = 20_000
MAX_DEPTH = 256
MAX_TEXT_TOKENS = 4096
MAX_RECENT = 1000
# Finished requests remembered, and how many prompt / output tokens each keeps.
RECENT_KEPT = 1000
KEPT_PROMPT_TOKENS = 4096
KEPT_OUTPUT_TOKENS = 1024
# Lock holders named per node (the rest are counted).
MAX_LOCK_NAMES = 8


@dataclass
class RequestRecord:
    """A finished request as the requests view shows it; times are seconds (wall clock)."""

    rid: str
    session_id: str | None
    program_call: dict[str, Any] | None  # io/messages.ProgramCall's fields
    priority: int
    stream: bool  # its tokens were streamed to the client
    arrival: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    max_new_tokens: int
    ttft: float | None
    itl: float | None
    e2e: float | None
    finish: dict[str, Any] | None
    prompt_ids: array = field(repr=False)
    output_ids: array = field(repr=False)


class RequestLog:
    """Live requests by rid and a bounded deque of finished ones, in arrival order."""

    def __init__(self) -> None:
        self.live: dict[str, Req] = {}
        self.recent: deque[RequestRecord] = deque(maxlen=RECENT_KEPT)
        # Converts the scheduler's monotonic times to wall-clock seconds for the page.
        self.epoch = time.time() - time.monotonic()

    def submitted(self, req: Req) -> None:
        self.live[req.rid] = req

    def ended(self, outputs: list[ReqOutput]) -> None:
        """Moves the requests that finished in a step from live to recent."""
        for o in outputs:
            if o.finished_reason is not None:
                req = self.live.pop(o.rid, None)
                if req is not None:
                    self.recent.append(self.record(req, time.monotonic(), KEPT_PROMPT_TOKENS))

    def record(self, req: Req, end: float | None, keep_tokens: int) -> RequestRecord:
        """req as a record keeping its first keep_tokens prompt tokens (and as many output tokens,
        up to KEPT_OUTPUT_TOKENS); end: when it finished (None: still live)."""
        first = req.first_token_time
        n_out = req.output_len
        return RequestRecord(
            rid=req.rid,
            session_id=req.session_id,
            program_call=None if req.program_call is None else msgspec.structs.asdict(req.program_call),
            priority=req.priority,
            stream=req.stream,
            arrival=self.epoch + req.arrival_time,
            prompt_tokens=req.prompt_len,
            cached_tokens=max(req.cached_tokens, 0),
            completion_tokens=n_out,
            max_new_tokens=req.sampling_params.max_new_tokens,
            ttft=None if first is None else first - req.arrival_time,
            itl=None if first is None or end is None or n_out < 2 else (end - first) / (n_out - 1),
            e2e=None if end is None else end - req.arrival_time,
            finish=req.finished_reason.to_json() if req.finished_reason is not None else None,
            prompt_ids=array("l", req.origin_input_ids[:keep_tokens]),
            output_ids=array(
                "l", req.token_ids[req.prompt_len : req.prompt_len + min(keep_tokens, KEPT_OUTPUT_TOKENS)]
            ),
        )

    def find(self, rid: str, keep_tokens: int) -> tuple[RequestRecord, str] | None:
        """The request by rid with its state (running, queued or finished)."""
        req = self.live.get(rid)
        if req is not None:
            return self.record(req, None, keep_tokens), _state(req)
        for rec in self.recent:
            if rec.rid == rid:
                return rec, "finished"
        return None


def _state(req: Req) -> str:
    return "running" if req.req_pool_idx is not None else "queued"


def answer(scheduler: Scheduler, log: RequestLog, m: DashboardReq) -> dict[str, Any]:
    """The snapshot m asks for, within this module's bounds, with when it was taken and the
    scheduler time it took (build_s: the HTTP side reuses a costly snapshot for longer)."""
    start = time.perf_counter()
    snap = _snapshot(scheduler, log, m)
    return snap | {"taken_at": time.time(), "build_s": time.perf_counter() - start}


def _snapshot(scheduler: Scheduler, log: RequestLog, m: DashboardReq) -> dict[str, Any]:
    text_tokens = min(max(m.text_tokens, 0), MAX_TEXT_TOKENS)
    if m.view == "tree":
        return tree_snapshot(
            scheduler, log, min(max(m.max_nodes, 1), MAX_NODES), min(m.max_depth, MAX_DEPTH), text_tokens
        )
    if m.view == "node":
        return node_snapshot(scheduler, log, m.node_id, text_tokens, min(max(m.max_recent, 0), MAX_RECENT))
    if m.view == "requests":
        return requests_snapshot(scheduler, log, min(max(m.max_recent, 0), MAX_RECENT), text_tokens)
    found = log.find(m.rid, text_tokens)  # view "request"
    return {"request": None if found is None else _request_dict(*found, text_tokens, with_output=True)}


# -- the radix tree ---------------------------------------------------------------------------------
def tree_snapshot(
    scheduler: Scheduler, log: RequestLog, max_nodes: int, max_depth: int, text_tokens: int
) -> dict[str, Any]:
    """The tree breadth first from the root, at most max_nodes nodes and max_depth levels. Children
    are sorted most recently used first only where the cut drops some, so it drops the coldest."""
    tree = scheduler.cache.tree
    if tree is None:
        return {"enabled": False, "truncated": False, "nodes": NodeColumns(text_tokens).data}
    cols = NodeColumns(text_tokens)
    queue: deque[tuple[TreeNode, int, int]] = deque([(tree.root_node, 0, 0)])
    truncated = False
    while queue:
        node, depth, prefix = queue.popleft()
        prefix += len(node.key)
        room = max(max_nodes - len(cols) - len(queue) - 1, 0) if depth < max_depth else 0
        children = node.children.values()
        if room < len(children):
            truncated = True
            children = sorted(children, key=lambda c: -c.last_access_time)[:room]
        cols.add(node, depth, prefix, len(node.children) - len(children))
        queue.extend((c, depth + 1, prefix) for c in children)
    return {
        "enabled": True,
        "nodes": cols.data,
        "locked_by": _lock_holders(tree, log),
        "truncated": truncated,
        "total_tokens": tree.total_size(),
        "evictable_tokens": tree.evictable_size(),
        "protected_tokens": tree.protected_size(),
        "max_total_tokens": scheduler.runner_info.max_total_tokens,
        "host_tokens": tree.host_size(),
        "host_tier_tokens": scheduler.runner_info.host_kv_tokens,
        "disk_tokens": tree.disk_size(),
        "disk_tier_tokens": scheduler.runner_info.disk_kv_tokens,
    }


class NodeColumns:
    """Nodes as one list per field: a snapshot of thousands of nodes is built and encoded in a
    fraction of the time of a dict per node, and it is the scheduler's time (the HTTP process turns
    it into rows). The root has parent -1; "ids" are each node's first text_tokens tokens."""

    FIELDS = ("id", "parent", "depth", "tokens", "prefix_tokens", "hits", "age_s", "lock_ref")
    FIELDS += ("children", "omitted_children", "tier", "ids")

    def __init__(self, text_tokens: int) -> None:
        self.text_tokens = text_tokens
        self.now = time.monotonic()
        self._rows: list[tuple[Any, ...]] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, node: TreeNode, depth: int, prefix: int, omitted: int) -> None:
        parent = node.parent
        self._rows.append(
            (
                node.id,
                -1 if parent is None else parent.id,
                depth,
                len(node.key),
                prefix,
                node.hits,
                round(self.now - node.accessed_at, 1),
                0 if parent is None else node.lock_ref,
                len(node.children),
                omitted,
                node.tier,
                node.key[: self.text_tokens],
            )
        )

    @property
    def data(self) -> dict[str, list[Any]]:
        columns = list(zip(*self._rows)) or [()] * len(self.FIELDS)
        return {field: list(column) for field, column in zip(self.FIELDS, columns)}


def _lock_holders(tree: RadixCache, log: RequestLog) -> dict[int, list[str]]:
    """Node id -> rids (up to MAX_LOCK_NAMES) of the live requests whose locked path passes through it."""
    holders: dict[int, list[str]] = {}
    for req in log.live.values():
        node = req.last_node
        while node is not None and node is not tree.root_node:
            names = holders.setdefault(node.id, [])
            if len(names) < MAX_LOCK_NAMES:
                names.append(req.rid)
            node = node.parent
    return holders


def node_snapshot(
    scheduler: Scheduler, log: RequestLog, node_id: int, text_tokens: int, max_recent: int
) -> dict[str, Any]:
    """One node: its own tokens and the requests (live, then the most recent first) whose prompt
    runs through it, i.e. starts with the tokens from the root to the end of the node."""
    tree = scheduler.cache.tree
    node = None if tree is None else tree.node(node_id)
    if tree is None or node is None:
        return {"node": None, "requests": []}
    nodes = _path(tree, node)
    path = [t for n in nodes for t in n.key]
    users = [
        (log.record(r, None, 0), _state(r)) for r in log.live.values() if r.token_ids[: len(path)] == path
    ]
    for rec in reversed(log.recent):
        if len(users) >= max_recent:
            break
        if len(path) <= len(rec.prompt_ids) and rec.prompt_ids[: len(path)].tolist() == path:
            users.append((rec, "finished"))
    cols = NodeColumns(text_tokens)
    cols.add(node, len(nodes), len(path), 0)
    info = {k: v[0] for k, v in cols.data.items()}
    info["locked_by"] = _lock_holders(tree, log).get(node.id, [])
    info["prefix_ids"] = path[max(len(path) - len(node.key) - text_tokens, 0) : len(path) - len(node.key)]
    return {"node": info, "requests": [_request_dict(rec, st, 0) for rec, st in users[:max_recent]]}


def _path(tree: RadixCache, node: TreeNode) -> list[TreeNode]:
    """The nodes from the root's child down to node."""
    nodes: list[TreeNode] = []
    while node is not tree.root_node and node is not None:
        nodes.append(node)
        node = node.parent  # type: ignore[assignment]
    return nodes[::-1]


# -- requests ---------------------------------------------------------------------------------------
def requests_snapshot(
    scheduler: Scheduler, log: RequestLog, max_recent: int, text_tokens: int
) -> dict[str, Any]:
    live = sorted(log.live.values(), key=lambda r: r.arrival_time)
    recent = list(log.recent)[-max_recent:] if max_recent else []
    return {
        "live": [
            _request_dict(log.record(r, None, text_tokens), _state(r), text_tokens) for r in live[:MAX_RECENT]
        ],
        "live_total": len(live),
        "recent": [_request_dict(rec, "finished", text_tokens) for rec in reversed(recent)],
        "pinned_sessions": sorted(scheduler.cache.sessions.pinned_ids()),
        "num_compiling": len(scheduler.constraints),
    }


def _request_dict(
    rec: RequestRecord, state: str, text_tokens: int, with_output: bool = False
) -> dict[str, Any]:
    out = {
        "rid": rec.rid,
        "state": state,
        "session_id": rec.session_id,
        "program_call": rec.program_call,
        "priority": rec.priority,
        "stream": rec.stream,
        "arrival": round(rec.arrival, 3),
        "prompt_tokens": rec.prompt_tokens,
        "cached_tokens": rec.cached_tokens,
        "completion_tokens": rec.completion_tokens,
        "max_new_tokens": rec.max_new_tokens,
        "ttft": rec.ttft,
        "itl": rec.itl,
        "e2e": rec.e2e,
        "finish": rec.finish,
        "prompt_ids": rec.prompt_ids[:text_tokens].tolist(),
    }
    if with_output:
        out["output_ids"] = rec.output_ids[: min(text_tokens, KEPT_OUTPUT_TOKENS)].tolist()
    return out
