"""Radix tree over token ids whose nodes own KV slots, so requests sharing a prefix share its KV.

Ownership model: a slot inside the tree belongs to the tree and is freed only by `evict`/`reset`.
Callers lock the node their prefix ends in while a request runs, which pins the whole path. Slots
are host integers: matching, inserting and evicting never touch the device.

Beside its KV a token may keep its logprob (and the most likely alternatives at its position), as
computed by a request that asked for them: a token's logprob depends only on the tokens before it,
so a later request that wants prompt logprobs can take them from the tree instead of recomputing
the whole prompt (loglikelihood scoring with `echo`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time

from radixlm_runtime.kvcache.allocator import TokenAllocator
from radixlm_runtime.step import TopLogprobs


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    """Length of the common prefix of edge and key[start:], without slicing key at every level."""
    n = min(len(edge), len(key) - start)
    for i in range(n):
        if edge[i] != key[start + i]:
            return i
    return n


class TreeNode:
    """One edge of the tree: `key` tokens and the KV slots (`value`) holding them."""

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "lock_ref",
        "last_access_time",
        "id",
        "logprobs",
        "top",
        "hits",
        "accessed_at",
    )

    _ids = itertools.count()

    def __init__(
        self,
        key: list[int],
        value: list[int],
        parent: TreeNode | None,
        last_access_time: float,
        lock_ref: int = 0,
    ) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = lock_ref
        self.last_access_time = last_access_time
        self.id = next(TreeNode._ids)
        # Per key token: its logprob (NaN: unknown) and its position's top alternatives (None:
        # unknown); None when no request that computed these tokens asked for logprobs.
        self.logprobs: list[float] | None = None
        self.top: list[TopLogprobs | None] | None = None
        # For the dashboard: requests admitted with a cached prefix through this node, and the wall
        # clock (time.monotonic) of its last access; LRU order keeps using the logical clock.
        self.hits = 0
        self.accessed_at = time.monotonic()

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class RadixCache:
    """Prefix cache with LRU eviction of unlocked leaves and O(1) size accounting.

    Eviction candidates sit in a heap of (access time, id, node): least recently used first, creation
    order breaking ties. An entry is pushed
    whenever a node may have become an unlocked leaf or was touched (a new access time), and checked
    when popped: entries of nodes since detached, locked, given children or touched again are
    dropped then. So evict costs O(k log n) for the k nodes it takes, not a walk of every leaf, and
    the heap is rebuilt from the tree when stale entries outnumber the nodes."""

    def __init__(self, allocator: TokenAllocator) -> None:
        self.allocator = allocator
        # A logical clock rather than wall time: strictly increasing, so LRU order is deterministic.
        self._clock = itertools.count(1)
        self.root_node = TreeNode([], [], None, 0.0, lock_ref=1)
        # Every node in the tree by id, the root's included: the dashboard looks nodes up by id, and a
        # walk would cost the scheduler time in proportion to the tree.
        self._nodes: dict[int, TreeNode] = {self.root_node.id: self.root_node}
        self._lru: list[tuple[float, int, TreeNode]] = []
        self._evictable_size = 0
        self._protected_size = 0

    def _tick(self) -> float:
        return float(next(self._clock))

    def node(self, node_id: int) -> TreeNode | None:
        """The node with this id while it is in the tree (split nodes keep their id on the lower part)."""
        return self._nodes.get(node_id)

    def num_nodes(self) -> int:
        return len(self._nodes)

    def match_prefix(self, key: list[int]) -> tuple[list[int], TreeNode]:
        """Longest cached prefix of key: its KV slots and the node the match ends in."""
        length, node = self.match_node(key)
        return self.path_slots(node) if length else [], node

    def match_node(self, key: list[int]) -> tuple[int, TreeNode]:
        """Length of key's longest cached prefix and the node it ends in, without gathering slots
        (the scheduler re-matches every waiting request each step but needs slots only at admission).

        A match ending inside an edge splits it, so the returned node can be locked to pin exactly
        the matched tokens.
        """
        node = self.root_node
        now = self._tick()
        wall = time.monotonic()
        node.last_access_time = now
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            child.accessed_at = wall
            node = child
            pos += n
        self._candidate(node)
        return pos, node

    def path_slots(self, node: TreeNode) -> list[int]:
        """KV slots of every token from the root down to node, in order."""
        parts: list[list[int]] = []
        while node is not self.root_node:
            parts.append(node.value)
            assert node.parent is not None, "path_slots on a node detached from the tree"
            node = node.parent
        return [s for part in reversed(parts) for s in part]

    def insert(
        self,
        key: list[int],
        value: list[int],
        logprobs: list[float] | None = None,
        top: list[TopLogprobs | None] | None = None,
    ) -> int:
        """Inserts key with its KV indices; returns how many leading tokens were already cached.

        The tree keeps its own slots for that prefix, so the caller must free its copies of them
        (value[caller_prefix_len:returned_len]) unless they are the very same slots. Known token
        logprobs (`logprobs`, NaN where unknown; `top`, None where unknown), aligned with key, fill
        in what the tree does not know yet.
        """
        if len(value) != len(key):
            raise ValueError(f"insert: key has {len(key)} tokens but value has {len(value)} slots")
        node = self.root_node
        now = self._tick()
        wall = time.monotonic()
        node.last_access_time = now
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(key[pos:], value[pos:], node, now)
                _learn_logprobs(leaf, logprobs, top, pos)
                node.children[key[pos]] = leaf
                self._nodes[leaf.id] = leaf
                self._evictable_size += len(leaf.key)
                self._candidate(leaf)
                return pos
            n = _common_prefix_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            child.accessed_at = wall
            _learn_logprobs(child, logprobs, top, pos)
            node = child
            pos += n
        self._candidate(node)
        return pos

    def path_logprobs(self, node: TreeNode) -> tuple[list[float], list[TopLogprobs | None]]:
        """Known logprobs (NaN: unknown) and top alternatives (None: unknown) of every token from
        the root down to node."""
        nodes: list[TreeNode] = []
        while node is not self.root_node:
            nodes.append(node)
            assert node.parent is not None, "path_logprobs on a node detached from the tree"
            node = node.parent
        logprobs: list[float] = []
        top: list[TopLogprobs | None] = []
        for n in reversed(nodes):
            logprobs.extend(n.logprobs if n.logprobs is not None else [math.nan] * len(n.key))
            top.extend(n.top if n.top is not None else [None] * len(n.key))
        return logprobs, top

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cuts child's edge after n tokens and returns the new upper node.

        The upper node inherits lock_ref because every lock on child also pinned these tokens; the
        token counters need no change since each token stays in a node of the same lock state.
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(child.key[:n], child.value[:n], parent, child.last_access_time, child.lock_ref)
        # Every hit on child passed through these tokens.
        upper.hits, upper.accessed_at = child.hits, child.accessed_at
        if child.logprobs is not None:
            upper.logprobs, child.logprobs = child.logprobs[:n], child.logprobs[n:]
        if child.top is not None:
            upper.top, child.top = child.top[:n], child.top[n:]
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        self._nodes[upper.id] = upper
        return upper

    def record_hit(self, node: TreeNode) -> None:
        """Counts one request admitted with the cached prefix ending in node on every node of that
        path (the dashboard's per-node hit count)."""
        while node is not self.root_node:
            node.hits += 1
            assert node.parent is not None, "record_hit on a node detached from the tree"
            node = node.parent

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pins node and all its ancestors so eviction cannot take the prefix from a running request."""
        while node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None, "inc_lock_ref on a node detached from the tree"
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        # Ancestors are locked at least as often as node, so checking node alone guards the whole path.
        if node is not self.root_node and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
        while node is not self.root_node:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                self._candidate(node)
            assert node.parent is not None, "dec_lock_ref on a node detached from the tree"
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Frees at least num_tokens slots if possible, taking unlocked leaves least recently used first.

        Returns the number of slots freed, which is less than asked when too little is evictable.
        """
        if num_tokens <= 0:
            return 0
        freed: list[int] = []
        num_freed = 0
        while num_freed < num_tokens and self._lru:
            touched, _, node = heapq.heappop(self._lru)
            if not self._is_candidate(node, touched):
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            del self._nodes[node.id]
            node.parent = None
            freed.extend(node.value)
            num_freed += len(node.key)
            self._evictable_size -= len(node.key)
            self._candidate(parent)
        self.allocator.free(freed)
        return num_freed

    def _candidate(self, node: TreeNode) -> None:
        """Queues node for eviction if it is an unlocked leaf now, at its current access time."""
        if node.lock_ref == 0 and not node.children and node is not self.root_node:
            heapq.heappush(self._lru, (node.last_access_time, node.id, node))
            if len(self._lru) > 2 * len(self._nodes) + 64:
                self._rebuild_lru()

    @staticmethod
    def _is_candidate(node: TreeNode, touched: float) -> bool:
        """Whether an entry queued at access time `touched` still stands: node in the tree, an
        unlocked leaf, not touched since (touching queued a newer entry)."""
        return (
            node.parent is not None
            and node.lock_ref == 0
            and not node.children
            and node.last_access_time == touched
        )

    def _rebuild_lru(self) -> None:
        self._lru = [
            (n.last_access_time, n.id, n)
            for n in self._nodes.values()
            if n is not self.root_node and n.lock_ref == 0 and not n.children
        ]
        heapq.heapify(self._lru)

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def reset(self) -> None:
        """Returns every cached slot to the allocator; refuses while a request still pins a path."""
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} tokens still locked")
        values: list[int] = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            values.extend(node.value)
            stack.extend(node.children.values())
            node.parent = None
        self.allocator.free(values)
        self.root_node.children = {}
        self._nodes = {self.root_node.id: self.root_node}
        self._lru = []
        self._evictable_size = 0

    def pretty_print(self) -> str:
        lines = [
            f"RadixCache total={self.total_size()} evictable={self._evictable_size} "
            f"protected={self._protected_size}"
        ]
        stack: list[tuple[TreeNode, int]] = [
            (c, 1) for c in sorted(self.root_node.children.values(), key=lambda c: c.key[0], reverse=True)
        ]
        while stack:
            node, depth = stack.pop()
            lines.append(
                f"{'  ' * depth}key={node.key} value={node.value} lock_ref={node.lock_ref} "
                f"t={node.last_access_time:g}"
            )
            children = sorted(node.children.values(), key=lambda c: c.key[0], reverse=True)
            stack.extend((c, depth + 1) for c in children)
        return "\n".join(lines)


def _learn_logprobs(
    node: TreeNode, logprobs: list[float] | None, top: list[TopLogprobs | None] | None, start: int
) -> None:
    """Records what the caller knows of node's tokens (key[start:start + len(node.key)]) where the
    node does not know it yet."""
    n = len(node.key)
    if logprobs is not None:
        given = logprobs[start : start + n]
        if any(not math.isnan(v) for v in given):
            own = node.logprobs or [math.nan] * n
            node.logprobs = [g if math.isnan(o) else o for o, g in zip(own, given)]
    if top is not None:
        given_top = top[start : start + n]
        if any(t is not None for t in given_top):
            own_top = node.top or [None] * n
            node.top = [
                o if o is not None and len(o) >= len(g or ()) else g for o, g in zip(own_top, given_top)
            ]
