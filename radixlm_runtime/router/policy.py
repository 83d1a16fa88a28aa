"""Which replica serves a request: cache-aware (longest prefix of what each replica was sent, unless
the loads are too uneven), round-robin or least-load; sessions stick to their replica.

The router sees request text, not token ids (it has no tokenizer, and it may front servers of other
tokenizers), so each replica's tree is the same `RadixCache` the scheduler uses, keyed on characters
instead of tokens, its "slots" a budget of remembered characters: the least recently matched text
goes first when a replica's budget is full. It approximates what the replica's own radix cache
holds, as SGLang's router does. Torch-free, like the scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from radixlm_runtime.config import RouterConfig
from radixlm_runtime.kvcache.allocator import TokenAllocator
from radixlm_runtime.kvcache.radix_cache import RadixCache

# Sessions remembered at most; the least recently used are forgotten first.
MAX_SESSIONS = 100_000


class NoReplica(Exception):
    """No replica is healthy."""


@dataclass(eq=False)
class Replica:
    url: str
    tree: RadixCache
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0  # requests sent to it since start
    failed: int = 0  # requests that could not reach it
    # Characters of the requests routed to it, and how many of those its tree already held.
    chars: int = 0
    matched_chars: int = 0

    def match(self, key: list[int]) -> int:
        """How many leading characters of key this replica was already sent."""
        return self.tree.match_node(key)[0]

    def remember(self, key: list[int]) -> int:
        """Adds key to the tree, evicting the least recently matched text to make room; returns how
        many leading characters it already held (what `match` would have said)."""
        tree = self.tree
        key = key[: tree.allocator.size]
        matched, node = tree.match_node(key)
        need = len(key) - matched
        if need == 0:
            return matched
        tree.inc_lock_ref(node)  # the matched part must survive the eviction below
        try:
            short = need - tree.allocator.available_size()
            if short > 0:
                tree.evict(short)
            fresh = tree.allocator.alloc(need)
            if fresh is not None:
                tree.insert(key, tree.path_slots(node) + fresh)
        finally:
            tree.dec_lock_ref(node)
        return matched


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        trees = (RadixCache(TokenAllocator(config.tree_chars)) for _ in config.worker_urls)
        self.replicas = [Replica(url.rstrip("/"), tree) for url, tree in zip(config.worker_urls, trees)]
        self._turn = 0
        self._sessions: OrderedDict[str, Replica] = OrderedDict()

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def choose(self, text: str, session_id: str | None = None) -> Replica:
        """The replica for a request whose prompt is `text` (the router's view of it: the prompt, or
        the chat messages serialized); counts it as in flight there until `done`."""
        live = self.healthy()
        if not live:
            raise NoReplica("no replica is healthy")
        key = [ord(c) for c in text]
        replica = self._sticky(session_id, live)
        if replica is None:
            replica = self._pick(key, live)
            if session_id is not None:
                self._sessions[session_id] = replica
                if len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
        replica.chars += len(key)
        replica.matched_chars += replica.remember(key)
        replica.in_flight += 1
        replica.routed += 1
        return replica

    def done(self, replica: Replica) -> None:
        replica.in_flight -= 1

    def _sticky(self, session_id: str | None, live: list[Replica]) -> Replica | None:
        """The replica that holds session_id's pinned KV, while it is healthy."""
        if session_id is None:
            return None
        replica = self._sessions.get(session_id)
        if replica is None or replica not in live:
            return None
        self._sessions.move_to_end(session_id)
        return replica

    def _pick(self, key: list[int], live: list[Replica]) -> Replica:
        policy = self.config.router_policy
        if policy == "round_robin":
            self._turn += 1
            return live[self._turn % len(live)]
        least = min(live, key=lambda r: (r.in_flight, r.routed))
        if policy == "least_load":
            return least
        busiest = max(r.in_flight for r in live)
        c = self.config
        uneven = busiest - least.in_flight > c.balance_abs_threshold
        if uneven and busiest > c.balance_rel_threshold * least.in_flight:
            return least
        matches = [(r.match(key), r) for r in live]
        best_len, best = max(matches, key=lambda m: (m[0], -m[1].in_flight))
        if key and best_len >= c.cache_threshold * len(key):
            return best
        # Nobody holds enough of it: the replica with the most room left in its tree, so new
        # prefixes spread over the replicas instead of crowding one.
        return max(live, key=lambda r: (r.tree.allocator.available_size(), -r.in_flight))
