"""Orders the waiting queue so that requests sharing a cached prefix run while it is still cached."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Set
from dataclasses import dataclass

from radixlm_runtime.kvcache.radix_cache import RadixCache, TreeNode
from radixlm_runtime.scheduler.req import Req

# Matching every waiting request against the tree each step costs O(total prompt length); past
# this queue length LPM falls back to arrival order, as the gain no longer pays for the walk.
LPM_MAX_QUEUE = 256
# What a prefix token on the host tier is worth in LPM order, a device token being worth 1: loading
# it back is a copy, far cheaper than recomputing it, but dearer than a hit in the pool.
HOST_HIT_WEIGHT = 0.5
# And a token on the disk tier only: a file read and a checksum before that copy, still cheaper than
# recomputing it (a forward through every layer), dearer than a host hit.
DISK_HIT_WEIGHT = 0.25


def hit_value(req: Req) -> float:
    """req's cached prefix in device-token equivalents (LPM's key)."""
    host_only = req.load_len - req.disk_len
    return req.prefix_len - (1 - HOST_HIT_WEIGHT) * host_only - (1 - DISK_HIT_WEIGHT) * req.disk_len


@dataclass(frozen=True)
class PriorityRule:
    """Request priorities with aging: a request's level is its priority (negated when low values go
    first) plus one for every `aging_s` seconds it has waited, so a flood of important work delays
    the rest but never starves it."""

    low_values_first: bool = False
    aging_s: float = 10.0
    clock: Callable[[], float] = time.monotonic

    def level(self, req: Req, now: float) -> int:
        own = -req.priority if self.low_values_first else req.priority
        return own + int((now - req.arrival_time) // self.aging_s)


class SchedulePolicy:
    def __init__(self, policy: str, tree: RadixCache | None, priority: PriorityRule | None = None) -> None:
        if policy not in ("lpm", "dfs-weight", "fcfs"):
            raise ValueError(f"schedule_policy must be 'lpm', 'dfs-weight' or 'fcfs', got {policy!r}")
        self.policy = policy if tree is not None else "fcfs"
        self.tree = tree
        self.priority = priority

    def order(self, waiting: list[Req], pinned_sessions: Set[str] = frozenset()) -> list[Req]:
        """Returns the queue in admission order, with each request's prefix match refreshed.

        With priorities, higher levels go first. Within a level, requests of a session holding
        pinned KV (a program run in flight) go before all others, each group keeping the policy's
        order: a program already under way finishes, and its pin stops taking memory, before new
        programs start and pin more.
        """
        if self.tree is not None:
            for req in waiting:
                self._match(req)
        ordered = self._policy_order(waiting)
        if self.priority is None and not pinned_sessions:
            return ordered
        rule = self.priority
        now = rule.clock() if rule is not None else 0.0

        def key(r: Req) -> tuple[int, bool]:
            return (-rule.level(r, now) if rule is not None else 0, r.session_id not in pinned_sessions)

        return sorted(ordered, key=key)

    def _match(self, req: Req) -> None:
        """Sets req's cached prefix. A request that needs prompt logprobs takes the ones the tree
        knows for its prefix, and uses the prefix only as far as those cover what it reports."""
        assert self.tree is not None
        key = req.token_ids[: req.max_prefix_len()]
        matched, node = self.tree.match_node(key)
        if req.needs_prompt_logprobs:
            req.learn_logprobs(*self.tree.path_logprobs(node))
            limit = req.logprob_limit(matched)
            if limit < matched:
                matched, node = self.tree.match_node(key[:limit])
        if self.tree.window:
            matched, node = self.tree.window_match(matched, node, host=True)
        req.prefix_len, req.last_node = matched, node
        req.load_len = self.tree.host_suffix(node)[0]
        req.disk_len = self.tree.disk_suffix(node)[0] if req.load_len else 0

    def _policy_order(self, waiting: list[Req]) -> list[Req]:
        if self.policy == "fcfs" or (self.policy == "lpm" and len(waiting) > LPM_MAX_QUEUE):
            return list(waiting)
        if self.policy == "lpm":
            return sorted(waiting, key=lambda r: -hit_value(r))
        return self._dfs_weight(waiting)

    def _dfs_weight(self, waiting: list[Req]) -> list[Req]:
        """Walks the radix tree depth-first, heaviest subtree (most waiting requests) first, so that
        requests under one cached node are admitted back to back."""
        assert self.tree is not None
        by_node: dict[TreeNode, list[Req]] = defaultdict(list)
        weight: dict[TreeNode, int] = defaultdict(int)
        for req in waiting:
            node = req.last_node
            by_node[node].append(req)
            while node is not None:
                weight[node] += 1
                node = node.parent
        ordered: list[Req] = []
        stack = [self.tree.root_node]
        while stack:
            node = stack.pop()
            ordered.extend(by_node.get(node, ()))
            children = [c for c in node.children.values() if weight.get(c, 0) > 0]
            stack.extend(sorted(children, key=lambda c: weight[c]))
        return ordered
