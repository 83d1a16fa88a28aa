"""Radix tree over token ids whose nodes own KV slots, so requests sharing a prefix share its KV.

Ownership model: a slot inside the tree belongs to the tree and is freed only by `evict`/`reset`.
Callers lock the node their prefix ends in while a request runs, which pins the whole path. Slots
are host integers: matching, inserting and evicting never touch the device.

Tiers: with a host allocator, eviction from the device pool demotes a node to the host tier (its
KV copied to host slots) instead of dropping it, and a match that runs into host-resident nodes
can `load` them back into fresh device slots. The copies are recorded here as plain data and run
by the executor before the next forward (`take_copies`, step.KVCopy), in the order recorded, so a
slot freed and reused within one step is read before it is overwritten. The device-resident nodes
always form a prefix-closed subtree: a node on the device has every ancestor on the device, so a
path is some device nodes, then host-only ones. The size counters count device tokens only.

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
from collections.abc import Callable

from radixlm_runtime.kvcache.allocator import TokenAllocator
from radixlm_runtime.step import KVCopy, TopLogprobs

# (access time, node id, node): heap entries of eviction candidates, least recently used first.
_Entry = tuple[float, int, "TreeNode"]


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    """Length of the common prefix of edge and key[start:], without slicing key at every level."""
    n = min(len(edge), len(key) - start)
    for i in range(n):
        if edge[i] != key[start + i]:
            return i
    return n


class TreeNode:
    """One edge of the tree: `key` tokens and where their KV is: device pool slots (`value`), host
    tier slots (`host_value`), or both; None where not in that tier."""

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "host_value",
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
        value: list[int] | None,
        parent: TreeNode | None,
        last_access_time: float,
        lock_ref: int = 0,
    ) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.host_value: list[int] | None = None
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

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def tier(self) -> str:
        """'device', 'host' or 'device+host' (the dashboard shows it)."""
        if self.host_value is None:
            return "device"
        return "device+host" if self.value is not None else "host"

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, tier={self.tier})"


class RadixCache:
    """Prefix cache with LRU eviction of unlocked leaves, O(1) size accounting and an optional host tier.

    Eviction candidates sit in heaps of (access time, id, node), least recently used first,
    creation order breaking ties: device candidates are unlocked nodes with no child on the device,
    host candidates are nodes with a host copy that is not the only copy of a locked or inner node.
    An entry is pushed whenever a node may have become a candidate or was touched, and checked when
    popped: entries of nodes since detached, locked or given children are dropped, those of nodes
    touched since are queued again at their new time. So evicting costs O(k log n) for the k nodes
    taken, not a walk of every leaf, and a heap is rebuilt when stale entries outnumber the nodes."""

    def __init__(
        self,
        allocator: TokenAllocator,
        host_allocator: TokenAllocator | None = None,
        write_through: bool = False,
    ) -> None:
        self.allocator = allocator
        self.host_allocator = host_allocator
        # Copy a node's KV to the host tier when it is cached, not when it leaves the device.
        self.write_through = write_through and host_allocator is not None
        # A logical clock rather than wall time: strictly increasing, so LRU order is deterministic.
        self._clock = itertools.count(1)
        self.root_node = TreeNode([], [], None, 0.0, lock_ref=1)
        # Every node in the tree by id, the root's included: the dashboard looks nodes up by id, and a
        # walk would cost the scheduler time in proportion to the tree.
        self._nodes: dict[int, TreeNode] = {self.root_node.id: self.root_node}
        self._lru: list[_Entry] = []
        self._host_lru: list[_Entry] = []
        self._copies: list[KVCopy] = []
        self._copy_dsts: set[int] = set()  # slots the last recorded batch writes
        self._evictable_size = 0
        self._protected_size = 0
        self._host_size = 0
        # Tokens moved since start: demoted to the host tier, loaded back, dropped from it.
        self.stored_tokens = self.loaded_tokens = self.host_evicted_tokens = 0

    def _tick(self) -> float:
        return float(next(self._clock))

    def node(self, node_id: int) -> TreeNode | None:
        """The node with this id while it is in the tree (split nodes keep their id on the lower part)."""
        return self._nodes.get(node_id)

    def num_nodes(self) -> int:
        return len(self._nodes)

    # -- matching and inserting --------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> tuple[list[int], TreeNode]:
        """Longest prefix of key cached on the device: its KV slots and the node the match ends in."""
        length, node = self.match_node(key)
        host_len, node = self.host_suffix(node)
        return self.path_slots(node) if length > host_len else [], node

    def match_node(self, key: list[int]) -> tuple[int, TreeNode]:
        """Length of key's longest cached prefix in any tier and the node it ends in, without
        gathering slots (the scheduler re-matches every waiting request each step but needs slots
        only at admission). `host_suffix` tells how much of it is on the host only.

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

    def host_suffix(self, node: TreeNode) -> tuple[int, TreeNode]:
        """Tokens at the end of node's path that are on the host only, and the deepest node of the
        path on the device (the root when none is)."""
        n = 0
        while not node.on_device:
            n += len(node.key)
            assert node.parent is not None, "host_suffix on a node detached from the tree"
            node = node.parent
        return n, node

    def path_slots(self, node: TreeNode) -> list[int]:
        """Device KV slots of every token from the root down to node (on the device), in order."""
        parts: list[list[int]] = []
        while node is not self.root_node:
            assert node.value is not None, "path_slots past the device tier: load the path first"
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
        """Inserts key with its device KV slots; returns how many leading tokens the tree already
        held on the device.

        The tree keeps its own slots for that prefix, so the caller must free its copies of them
        (value[caller_prefix_len:returned_len]) unless they are the very same slots. Past it the tree
        takes the caller's slots, for host-only nodes too (which are then on both tiers). Known token
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
        on_device = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(key[pos:], value[pos:], node, now)
                _learn_logprobs(leaf, logprobs, top, pos)
                node.children[key[pos]] = leaf
                self._nodes[leaf.id] = leaf
                self._evictable_size += len(leaf.key)
                self._candidate(leaf)
                if self.write_through:
                    self._back_up(leaf)
                return on_device
            n = _common_prefix_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            if child.on_device:
                on_device = pos + n
            else:
                self._give_device_slots(child, value[pos : pos + n])
            child.last_access_time = now
            child.accessed_at = wall
            _learn_logprobs(child, logprobs, top, pos)
            node = child
            pos += n
        self._candidate(node)
        return on_device

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
        token counters need no change since each token stays in a node of the same lock state and tier.
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper_value = None if child.value is None else child.value[:n]
        upper = TreeNode(child.key[:n], upper_value, parent, child.last_access_time, child.lock_ref)
        # Every hit on child passed through these tokens.
        upper.hits, upper.accessed_at = child.hits, child.accessed_at
        if child.logprobs is not None:
            upper.logprobs, child.logprobs = child.logprobs[:n], child.logprobs[n:]
        if child.top is not None:
            upper.top, child.top = child.top[:n], child.top[n:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
            self._host_candidate(upper)
        child.key = child.key[n:]
        if child.value is not None:
            child.value = child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        self._nodes[upper.id] = upper
        self._candidate(upper)
        return upper

    # -- hits and locks ----------------------------------------------------------------------
    def record_hit(self, node: TreeNode) -> None:
        """Counts one request admitted with the cached prefix ending in node on every node of that
        path (the dashboard's per-node hit count)."""
        while node is not self.root_node:
            node.hits += 1
            assert node.parent is not None, "record_hit on a node detached from the tree"
            node = node.parent

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pins node and all its ancestors so eviction cannot take the prefix from a running request
        (nor, from the host tier, a path being loaded)."""
        while node is not self.root_node:
            if node.lock_ref == 0 and node.on_device:
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
                if node.on_device:
                    self._evictable_size += len(node.key)
                    self._protected_size -= len(node.key)
                self._candidate(node)
                self._host_candidate(node)
            assert node.parent is not None, "dec_lock_ref on a node detached from the tree"
            node = node.parent

    # -- the device tier ---------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Frees at least num_tokens device slots if possible, taking unlocked leaves of the device
        tier least recently used first: demoted to the host tier when there is one and it has room,
        else dropped. Returns the number of slots freed, less than asked when too little is evictable.
        """
        if num_tokens <= 0:
            return 0
        freed: list[int] = []
        num_freed = 0
        while num_freed < num_tokens and self._lru:
            touched, _, node = heapq.heappop(self._lru)
            if not self._is_device_candidate(node):
                continue
            if node.last_access_time != touched:
                self._candidate(node)  # touched since: queued again at its new time
                continue
            assert node.value is not None and node.parent is not None
            freed.extend(node.value)
            num_freed += len(node.key)
            self._evictable_size -= len(node.key)
            parent = node.parent
            if not self._demote(node):
                self._drop(node)
            self._candidate(parent)
        self.allocator.free(freed)
        return num_freed

    def _candidate(self, node: TreeNode) -> None:
        """Queues node for device eviction if it is a candidate now, at its current access time."""
        if self._is_device_candidate(node):
            heapq.heappush(self._lru, (node.last_access_time, node.id, node))
            if len(self._lru) > 2 * len(self._nodes) + 64:
                self._lru = self._rebuilt(self._is_device_candidate)

    def _is_device_candidate(self, node: TreeNode) -> bool:
        """An unlocked node on the device, in the tree, with no child on the device."""
        return (
            node.on_device
            and node.lock_ref == 0
            and node.parent is not None
            and not any(c.on_device for c in node.children.values())
        )

    def _give_device_slots(self, node: TreeNode, slots: list[int]) -> None:
        """Puts a host-only node back on the device in `slots` (loaded, or recomputed by a caller)."""
        node.value = slots
        if node.lock_ref:
            self._protected_size += len(slots)
        else:
            self._evictable_size += len(slots)
        self._candidate(node)
        self._host_candidate(node)  # its host copy is now a spare one

    # -- the host tier -----------------------------------------------------------------------
    def load(self, node: TreeNode) -> int:
        """Brings the host-only nodes of node's path back onto the device, in fresh slots that the
        next step's copies fill before its forward. Returns how many tokens it loaded; 0 with the
        path unchanged when the device has no room for them."""
        n, _ = self.host_suffix(node)
        if n == 0:
            return 0
        # Locked while making room: the eviction that follows must take neither this path's device
        # part nor, from the host tier, its host part.
        self.inc_lock_ref(node)
        try:
            short = n - self.allocator.available_size()
            if short > 0:
                self.evict(short)
            slots = self.allocator.alloc(n)
            if slots is None:
                return 0
            path: list[TreeNode] = []
            walk = node
            while not walk.on_device:
                path.append(walk)
                assert walk.parent is not None
                walk = walk.parent
            offset = 0
            for host_node in reversed(path):
                assert host_node.host_value is not None
                part = slots[offset : offset + len(host_node.key)]
                offset += len(part)
                self._record(False, host_node.host_value, part)
                self._give_device_slots(host_node, part)
            self.loaded_tokens += n
            return n
        finally:
            self.dec_lock_ref(node)

    def _demote(self, node: TreeNode) -> bool:
        """Keeps node's KV in the host tier as it leaves the device (copied there unless a copy is
        there already); False when there is no host tier or no room in it."""
        if node.host_value is None and not self._back_up(node):
            return False
        node.value = None
        self._host_candidate(node)
        return True

    def _back_up(self, node: TreeNode) -> bool:
        """Copies a device node's KV to fresh host slots; False when the host tier has no room."""
        assert node.value is not None and node.host_value is None
        host = self._alloc_host(len(node.key))
        if host is None:
            return False
        self._record(True, node.value, host)
        node.host_value = host
        self._host_size += len(host)
        self.stored_tokens += len(host)
        self._host_candidate(node)
        return True

    def _alloc_host(self, n: int) -> list[int] | None:
        if self.host_allocator is None or n > self.host_allocator.size:
            return None
        short = n - self.host_allocator.available_size()
        if short > 0:
            self._evict_host(short)
        return self.host_allocator.alloc(n)

    def _evict_host(self, num_tokens: int) -> None:
        """Frees host slots, least recently used first: spare copies of nodes on the device, and
        host-only leaves, which leave the tree."""
        freed = 0
        while freed < num_tokens and self._host_lru:
            touched, _, node = heapq.heappop(self._host_lru)
            if not self._is_host_candidate(node):
                continue
            if node.last_access_time != touched:
                self._host_candidate(node)
                continue
            assert node.host_value is not None
            freed += len(node.host_value)
            self.host_evicted_tokens += len(node.host_value)
            if node.on_device:
                self._free_host(node)
            else:
                parent = node.parent
                assert parent is not None
                self._drop(node)
                self._host_candidate(parent)

    def _host_candidate(self, node: TreeNode) -> None:
        if self._is_host_candidate(node):
            heapq.heappush(self._host_lru, (node.last_access_time, node.id, node))
            if len(self._host_lru) > 2 * len(self._nodes) + 64:
                self._host_lru = self._rebuilt(self._is_host_candidate)

    @staticmethod
    def _is_host_candidate(node: TreeNode) -> bool:
        """A node in the tree with a host copy that is spare (the node is on the device too), or
        the only copy of an unlocked host-only leaf."""
        if node.host_value is None or node.parent is None:
            return False
        return node.on_device or (node.lock_ref == 0 and not node.children)

    def _free_host(self, node: TreeNode) -> None:
        assert node.host_value is not None and self.host_allocator is not None
        self.host_allocator.free(node.host_value)
        self._host_size -= len(node.host_value)
        node.host_value = None

    def _drop(self, node: TreeNode) -> None:
        """Takes node (its device slots already freed by the caller, if it had any) and everything
        below it, host-only by the tiers' invariant, out of the tree."""
        assert node.parent is not None
        del node.parent.children[node.key[0]]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n is node or not n.on_device, "a device node below one leaving the device"
            if n.host_value is not None:
                self._free_host(n)
            del self._nodes[n.id]
            n.parent = None
            stack.extend(n.children.values())

    def _record(self, to_host: bool, src: list[int], dst: list[int]) -> None:
        """Appends a copy to the pending ones; a new batch where this one would write a slot twice."""
        last = self._copies[-1] if self._copies else None
        if last is None or last.to_host != to_host or not self._copy_dsts.isdisjoint(dst):
            last = KVCopy(to_host)
            self._copies.append(last)
            self._copy_dsts = set()
        last.src.extend(src)
        last.dst.extend(dst)
        self._copy_dsts.update(dst)

    def take_copies(self) -> list[KVCopy]:
        """The copies recorded since the last call, for the next step to run before its forward."""
        copies, self._copies, self._copy_dsts = self._copies, [], set()
        return copies

    def _rebuilt(self, is_candidate: Callable[[TreeNode], bool]) -> list[_Entry]:
        heap = [(n.last_access_time, n.id, n) for n in self._nodes.values() if is_candidate(n)]
        heapq.heapify(heap)
        return heap

    # -- sizes -------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        """Tokens the tree holds on the device."""
        return self._evictable_size + self._protected_size

    def host_size(self) -> int:
        """Host tier slots the tree holds."""
        return self._host_size

    def reset(self) -> None:
        """Returns every cached slot of both tiers to its allocator; refuses while a request still
        pins a path."""
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} tokens still locked")
        values: list[int] = []
        host: list[int] = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            values.extend(node.value or ())
            host.extend(node.host_value or ())
            stack.extend(node.children.values())
            node.parent = None
        self.allocator.free(values)
        if self.host_allocator is not None:
            self.host_allocator.free(host)
        self.root_node.children = {}
        self._nodes = {self.root_node.id: self.root_node}
        self._lru, self._host_lru = [], []
        self.take_copies()
        self._evictable_size = self._host_size = 0

    def pretty_print(self) -> str:
        lines = [
            f"RadixCache total={self.total_size()} evictable={self._evictable_size} "
            f"protected={self._protected_size} host={self._host_size}"
        ]
        stack: list[tuple[TreeNode, int]] = [
            (c, 1) for c in sorted(self.root_node.children.values(), key=lambda c: c.key[0], reverse=True)
        ]
        while stack:
            node, depth = stack.pop()
            lines.append(
                f"{'  ' * depth}key={node.key} value={node.value} host={node.host_value} "
                f"lock_ref={node.lock_ref} t={node.last_access_time:g}"
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
