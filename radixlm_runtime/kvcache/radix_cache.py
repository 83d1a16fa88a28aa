"""Radix tree over token ids whose nodes own KV slots, so requests sharing a prefix share its KV.

Ownership model: a slot inside the tree belongs to the tree and is freed only by `evict`/`reset`.
Callers lock the node their prefix ends in while a request runs, which pins the whole path. Slots
are host integers: matching, inserting and evicting never touch the device.

Tiers: a node's KV lives in the device pool (`value`), the host tier (`host_value`), the disk tier
(`disk_value`), or several of these; each is a list of that tier's slots (host integers, handed out
by one TokenAllocator per tier) or None.
- Eviction from the device pool demotes a node to the host tier (its KV copied to host slots) instead
  of dropping it; eviction from the host tier demotes a host-only node to the disk tier (written to a
  file by the executor) instead of dropping it; eviction from the disk tier drops it. With
  write-through a node is copied to the host tier (`write_through`) or written to disk
  (`disk_write_through`, so that what was computed survives a restart) as soon as it is cached,
  and leaving a tier then costs no copy.
- A match walks every tier. Host-resident nodes at the end of it are loaded back into fresh device
  slots (`load`). Disk-only ones are first read into host slots (`fetch`) through a callback that
  runs the moves at once and reports the disk slots whose file failed its checksum: those nodes are
  dropped (recomputed), never served.
- The copies are recorded here as plain data (step.KVCopy; to no tier: disk slots let go) and
  run by the executor in the order recorded, before the next forward (`take_copies`), so a slot
  freed and reused within one step is read before it is overwritten.
- Tiers nest: the device nodes form a prefix-closed subtree (a node on the device has its parent on
  the device), and so do the nodes in memory (device or host): a path is some device nodes, then
  host-only ones, then disk-only ones.
- Each tier evicts least recently used first from a heap of its candidates, checked lazily when
  popped, so evicting k nodes costs O(k log n) whatever the size of the tree.
- The disk tier's slots are charged in whole entry files: writing a node costs the slots of its file
  (`disk_entry_cost`: its tokens and its header's bytes, in whole tokens' worth), and they are
  free again only when the last of the entry's tokens is let go (the executor then deletes the
  file): a node split, then partly evicted, keeps its file, so the tree keeps counting all of it.
  So the files on disk never take more than the disk tier's slots' worth of bytes.
- A restarted server rebuilds the disk part of a fresh tree from the entries the executor found in
  its disk directory (`restore`: each entry names its path's token ids); at shutdown, what is only
  in memory is written first (`persist`), as far as the disk tier has room.
The size counters (`evictable_size`, `protected_size`) count device tokens; `host_size` and
`disk_size` the slots held in the lower tiers.

Windows (a windowed pool, kvcache/pool.py): with `window` W, a token's slot may come with a window
slot holding the KV of the sliding-window layers (WindowedAllocator). A prefix can be served only
where the W - 1 tokens before its end still have theirs, so a node keeps its window slots (`window`)
or none, the match is cut back to the deepest end that has them (`window_match`), a running
request locks the W - 1 tokens before its cached end (`lock_window`), and under pressure the
windows of unlocked nodes go least recently used first (`evict_windows`) while their tokens stay.
The host tier stores what the pool stores: a node within a window before a sequence's end
(`mark_tail`) that leaves the device, or whose windows are evicted from the pool (`evict_windows`: the
tokens stay), keeps its windows in host window slots beside its host copy (all or none; the least
recently used of those go for room); windows inside cached sequences are not kept. So does the disk
tier: such a node's entry holds its windows (written again with them where it was written through
before it ended a sequence), and reading it back gives its host copy host windows. Matching counts
the windows of lower tiers' copies as loadable (`window_match` with `host`); admitting loads those of
the W - 1 tokens before the match's end back into device window slots (`load_windows`), which is all
a request reads.

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
from collections import deque
from collections.abc import Callable, Iterable
from typing import Literal

from radixlm_runtime.kvcache.allocator import TokenAllocator, WindowedAllocator
from radixlm_runtime.step import DiskEntry, KVCopy, Tier, TopLogprobs

# The eviction candidates a heap queues: each tier's, and the nodes whose window slots can go.
_Heap = Tier | Literal["window", "window_tail", "host_window"]

# (access time, node id, node): heap entries of eviction candidates, least recently used first.
_Entry = tuple[float, int, "TreeNode"]
# Runs tier moves at once; returns the disk slots whose data failed its checksum (Executor.move_kv).
Mover = Callable[[list[KVCopy]], list[int]]
# Disk slots an entry file of n tokens under a path of p tokens, with their windows or not, costs
# (RunnerInfo.disk_entry_slots).
EntryCost = Callable[[int, int, bool], int]


class _DiskFile:
    """One entry file of the disk tier: its tokens still held by nodes, every disk slot it costs
    (its tokens', its header's and its window rows'), freed together once none of its tokens is
    held, and whether it holds its tokens' windows."""

    __slots__ = ("live", "slots", "windows")

    def __init__(self, live: int, slots: list[int], windows: bool) -> None:
        self.live = live
        self.slots = slots
        self.windows = windows


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    """Length of the common prefix of edge and key[start:], without slicing key at every level."""
    n = min(len(edge), len(key) - start)
    for i in range(n):
        if edge[i] != key[start + i]:
            return i
    return n


class TreeNode:
    """One edge of the tree: `key` tokens and where their KV is: device pool slots (`value`), host
    tier slots (`host_value`), disk tier slots (`disk_value`), or several; None where not in that tier."""

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "host_value",
        "disk_value",
        "lock_ref",
        "last_access_time",
        "id",
        "logprobs",
        "top",
        "hits",
        "accessed_at",
        "window",
        "window_lock",
        "window_tail",
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
        self.disk_value: list[int] | None = None
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
        # Windowed pools: whether its tokens' window slots are held (all or none), and how many
        # running requests need them (RadixCache.lock_window).
        self.window = False
        self.window_lock = 0
        # Within the window before the end of a finished sequence (RadixCache.mark_tail): where a
        # later request's match ends (a follow-up turn), so its windows go after the others.
        self.window_tail = False

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def in_memory(self) -> bool:
        """On the device or in the host tier: loadable without reading the disk."""
        return self.value is not None or self.host_value is not None

    @property
    def tier(self) -> str:
        """The tiers holding the node's KV, '+'-joined: 'device', 'host', 'disk', 'device+host',
        'host+disk', ... (the dashboard shows it)."""
        places = (("device", self.value), ("host", self.host_value), ("disk", self.disk_value))
        return "+".join(name for name, slots in places if slots is not None)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, tier={self.tier})"


class RadixCache:
    """Prefix cache with LRU eviction of unlocked leaves, O(1) size accounting and optional host and
    disk tiers.

    Eviction candidates sit in one heap per tier of (access time, id, node), least recently used
    first, creation order breaking ties: device candidates are unlocked nodes with no child on the
    device; host candidates are nodes with a host copy that is spare (the node is on the device) or
    the only in-memory copy of an unlocked node with no child in memory; disk candidates are nodes
    with a disk copy that is spare (the node is in memory) or the only copy of an unlocked leaf.
    An entry is pushed whenever a node may have become a candidate or was touched, and checked when
    popped: entries of nodes since detached, locked or given children are dropped, those of nodes
    touched since are queued again at their new time. So evicting costs O(k log n) for the k nodes
    taken, not a walk of every leaf, and a heap is rebuilt when stale entries outnumber the nodes."""

    def __init__(
        self,
        allocator: TokenAllocator,
        host_allocator: TokenAllocator | None = None,
        write_through: bool = False,
        disk_allocator: TokenAllocator | None = None,
        disk_write_through: bool = False,
        disk_entry_cost: EntryCost | None = None,
        window: int = 0,
    ) -> None:
        """`disk_entry_cost`: the disk slots an entry file costs (None: one per token, no header).
        `window`: the widest sliding window of a windowed pool, whose slots `allocator` (then a
        WindowedAllocator) hands out beside the tokens'; 0: none."""
        if disk_allocator is not None and host_allocator is None:
            raise ValueError("a disk tier needs a host tier to load through")
        if window and not isinstance(allocator, WindowedAllocator):
            raise ValueError("window slots need a WindowedAllocator")
        self.window = window
        self.allocator = allocator
        self.host_allocator = host_allocator
        self.disk_allocator = disk_allocator
        # Copy a node's KV to the host tier when it is cached, not when it leaves the device.
        self.write_through = write_through and host_allocator is not None
        # Write a node's KV to the disk tier when it is cached, not when it leaves the host tier.
        self.disk_write_through = disk_write_through and disk_allocator is not None
        self._disk_cost: EntryCost = disk_entry_cost or (lambda n, _path, _windows: n)
        # The entry file of every disk slot a node holds.
        self._disk_files: dict[int, _DiskFile] = {}
        # A logical clock rather than wall time: strictly increasing, so LRU order is deterministic.
        self._clock = itertools.count(1)
        self.root_node = TreeNode([], [], None, 0.0, lock_ref=1)
        # Every node in the tree by id, the root's included: the dashboard looks nodes up by id, and a
        # walk would cost the scheduler time in proportion to the tree.
        self._nodes: dict[int, TreeNode] = {self.root_node.id: self.root_node}
        # Per tier, its eviction candidates' heap entries (some stale: checked when popped).
        self._heaps: dict[_Heap, list[_Entry]] = {
            "device": [],
            "host": [],
            "disk": [],
            "window": [],
            "window_tail": [],
            "host_window": [],
        }
        self._copies: list[KVCopy] = []
        self._copy_dsts: set[int] = set()  # slots the last recorded batch writes
        self._evictable_size = 0
        self._protected_size = 0
        self._window_evictable_size = 0  # tokens of device nodes with windows and no window lock
        self._host_size = 0
        self._disk_size = 0
        # Tokens moved since start: demoted to the host tier, loaded back, dropped from it; written
        # to the disk tier, read back, dropped from it, and dropped for a failed checksum.
        self.stored_tokens = self.loaded_tokens = self.host_evicted_tokens = 0
        self.disk_stored_tokens = self.disk_loaded_tokens = self.disk_evicted_tokens = 0
        # Window slots' rows moved likewise (a windowed pool): stored to and loaded from each tier.
        self.stored_windows = self.loaded_windows = self.disk_stored_windows = self.disk_loaded_windows = 0
        self.disk_failed_tokens = 0

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
        self._push("device", node)
        return pos, node

    def host_suffix(self, node: TreeNode) -> tuple[int, TreeNode]:
        """Tokens at the end of node's path that are not on the device (on the host, or on disk
        only), and the deepest node of the path on the device (the root when none is)."""
        n = 0
        while not node.on_device:
            n += len(node.key)
            assert node.parent is not None, "host_suffix on a node detached from the tree"
            node = node.parent
        return n, node

    def disk_suffix(self, node: TreeNode) -> tuple[int, TreeNode]:
        """Tokens at the end of node's path that are on disk only, and the deepest node of the path
        in memory (the root when none is)."""
        n = 0
        while not node.in_memory and node is not self.root_node:
            n += len(node.key)
            assert node.parent is not None, "disk_suffix on a node detached from the tree"
            node = node.parent
        return n, node

    def disk_path_slots(self, node: TreeNode) -> list[int]:
        """Disk slots of the disk-only end of node's path (what `fetch` reads), top down; none
        where node has left the tree. Changes nothing: what the executor may read ahead."""
        if self._nodes.get(node.id) is not node:
            return []
        parts: list[list[int]] = []
        while not node.in_memory and node is not self.root_node:
            assert node.disk_value is not None and node.parent is not None
            parts.append(node.disk_value)
            node = node.parent
        return [s for part in reversed(parts) for s in part]

    def path_key(self, node: TreeNode) -> list[int]:
        """Token ids from the root down to node."""
        parts: list[list[int]] = []
        while node is not self.root_node:
            parts.append(node.key)
            assert node.parent is not None, "path_key on a node detached from the tree"
            node = node.parent
        return [t for part in reversed(parts) for t in part]

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
                self._push("device", leaf)
                if self.window:
                    self._take_windows(leaf)  # (which may split it: the part above has none)
                new = [leaf] if leaf.parent is node else [leaf.parent, leaf]
                for n in new:
                    if self.write_through:
                        self._back_up(n)
                    if self.disk_write_through:
                        self._back_up_disk(n, "device")
                return on_device
            n = _common_prefix_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            if child.on_device:
                on_device = pos + n
                if self.window and not child.window and child.value != value[pos : pos + n]:
                    child = self._adopt_windows(child, value[pos : pos + n])
            else:
                self._give_device_slots(child, value[pos : pos + n])
                if self.window:  # recomputed by the caller, whose window slots come with its slots
                    self._take_windows(child)
            child.last_access_time = now
            child.accessed_at = wall
            _learn_logprobs(child, logprobs, top, pos)
            node = child
            pos += n
        self._push("device", node)
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
        upper.window, upper.window_lock, upper.window_tail = (
            child.window,
            child.window_lock,
            child.window_tail,
        )
        self._push("window", upper)
        self._push("window_tail", upper)
        if child.logprobs is not None:
            upper.logprobs, child.logprobs = child.logprobs[:n], child.logprobs[n:]
        if child.top is not None:
            upper.top, child.top = child.top[:n], child.top[n:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
            self._push("host", upper)
            self._push("host_window", upper)
        if child.disk_value is not None:
            upper.disk_value, child.disk_value = child.disk_value[:n], child.disk_value[n:]
            self._push("disk", upper)
        child.key = child.key[n:]
        if child.value is not None:
            child.value = child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        self._nodes[upper.id] = upper
        self._push("device", upper)
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
                self._push("device", node)
                self._push("host", node)
                self._push("disk", node)
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
        while num_freed < num_tokens and (node := self._pop_lru("device")) is not None:
            assert node.value is not None and node.parent is not None
            freed.extend(node.value)
            num_freed += len(node.key)
            self._evictable_size -= len(node.key)
            parent = node.parent
            window = node.window
            if not self._demote(node):  # (a copy to the host tier reads its windows first)
                self._drop(node)
            if window:  # its window slots go with its slots (WindowedAllocator.free)
                node.window = False
                self._window_evictable_size -= len(node.key)
            self._push("device", parent)
        self.allocator.free(freed)
        return num_freed

    def _push(self, tier: _Heap, node: TreeNode) -> None:
        """Queues node for eviction from tier if it is a candidate there now, at its current access
        time; rebuilds the heap from the tree when stale entries outnumber the nodes."""
        is_candidate = self._is_candidate(tier)
        if is_candidate(node):
            heap = self._heaps[tier]
            heapq.heappush(heap, (node.last_access_time, node.id, node))
            if len(heap) > 2 * len(self._nodes) + 64:
                self._heaps[tier] = self._rebuilt(is_candidate)

    def _pop_lru(self, tier: _Heap) -> TreeNode | None:
        """Takes the least recently used eviction candidate of tier off its heap (None: there is
        none): entries of nodes that are no longer candidates are dropped, those of nodes touched
        since they were queued are queued again at their new time."""
        while self._heaps[tier]:
            touched, _, node = heapq.heappop(self._heaps[tier])
            if not self._is_candidate(tier)(node):
                continue
            if node.last_access_time != touched:
                self._push(tier, node)
                continue
            return node
        return None

    def _is_candidate(self, tier: _Heap) -> Callable[[TreeNode], bool]:
        if tier == "device":
            return self._is_device_candidate
        if tier == "window":
            return self._is_window_candidate
        if tier == "window_tail":
            return self._is_window_tail_candidate
        if tier == "host_window":
            return self._is_host_window_candidate
        return self._is_host_candidate if tier == "host" else self._is_disk_candidate

    @staticmethod
    def _is_device_candidate(node: TreeNode) -> bool:
        """An unlocked node on the device, in the tree, with no child on the device."""
        return (
            node.on_device
            and node.lock_ref == 0
            and node.parent is not None
            and not any(c.on_device for c in node.children.values())
        )

    # -- window slots (a windowed pool) -------------------------------------------------------
    @staticmethod
    def _window_evictable(node: TreeNode) -> bool:
        """A node in the tree holding window slots that no running request needs."""
        return node.window and node.window_lock == 0 and node.parent is not None

    @classmethod
    def _is_window_candidate(cls, node: TreeNode) -> bool:
        """Window-evictable, and no finished sequence ends within a window after it."""
        return cls._window_evictable(node) and not node.window_tail

    @classmethod
    def _is_window_tail_candidate(cls, node: TreeNode) -> bool:
        """Window-evictable, within a window before the end of a finished sequence (mark_tail)."""
        return cls._window_evictable(node) and node.window_tail

    def _push_window(self, node: TreeNode) -> None:
        self._push("window_tail" if node.window_tail else "window", node)

    def mark_tail(self, node: TreeNode) -> None:
        """The W tokens ending at node end a finished sequence: a later turn's prompt matches up to
        there (and the same prompt sent again up to one before), so their windows are evicted only
        after those inside cached sequences (a long document's, whose windows no later prompt ends
        in), and kept in the lower tiers."""
        for n in self._window_span(node, self.window):
            n.window_tail = True
            self._push_window(n)
            if n.window and n.disk_value is not None and not self._disk_windowed(n):
                # Written through before it ended a sequence: written again, with its windows.
                self._free_disk(n)
                self._back_up_disk(n, "device")

    def _set_window(self, node: TreeNode, held: bool) -> None:
        """Marks node's window slots held or not (the allocator's are set by the caller)."""
        if node.window == held:
            return
        node.window = held
        if node.window_lock == 0:
            self._window_evictable_size += len(node.key) if held else -len(node.key)
        self._push_window(node)

    def _take_windows(self, leaf: TreeNode) -> None:
        """A node given a caller's slots (a new leaf, or a host-only node recomputed) keeps their
        window slots from the last one without on (the caller dropped those before, out of its
        window): split there, the part above keeps none."""
        assert leaf.value is not None and isinstance(self.allocator, WindowedAllocator)
        start = self.allocator.windowed_from(leaf.value)
        self.allocator.drop_windows(leaf.value[:start])
        if start == len(leaf.value):
            return
        if start > 0:
            self._split(leaf, start)  # leaf is now the part from `start` on
        self._set_window(leaf, True)

    def _adopt_windows(self, node: TreeNode, slots: list[int]) -> TreeNode:
        """The tree's device node without windows matched by a caller's own slots (the same tokens
        computed again): the tree takes the caller's window slots where the caller has them to the
        end of the node (split there), since the caller reads the tree's slots from now on and may
        need them. Returns the node ending where `node` did."""
        assert node.value is not None and isinstance(self.allocator, WindowedAllocator)
        start = self.allocator.windowed_from(slots)
        if start == len(slots):
            return node
        if start > 0:
            self._split(node, start)
        self.allocator.move_windows(slots[start:], node.value)
        self._set_window(node, True)
        return node

    def window_match(self, length: int, node: TreeNode, host: bool = False) -> tuple[int, TreeNode]:
        """The deepest end at or above node (a prefix of `length` tokens) that the W - 1 tokens
        before it have windows for: where a request can start computing from cached KV. With `host`,
        windows that a lower tier holds count too (what admitting may load: `load_windows` from the
        host tier, `fetch` from disk for a node on disk only)."""
        need = self.window - 1
        run = 0
        end, end_len = node, length
        while node is not self.root_node and run < need:
            assert node.parent is not None
            if node.window or (host and self._lower_windowed(node)):
                run += len(node.key)
            else:
                end, end_len, run = node.parent, length - len(node.key), 0
            length -= len(node.key)
            node = node.parent
        return end_len, end

    def _window_span(self, node: TreeNode, tokens: int = 0) -> list[TreeNode]:
        """The nodes of the W - 1 tokens (or `tokens`) ending at node, split so that they are exactly
        those."""
        need = tokens or self.window - 1
        span: list[TreeNode] = []
        while need > 0 and node is not self.root_node:
            if len(node.key) > need:
                self._split(node, len(node.key) - need)  # node keeps the last `need` tokens
            span.append(node)
            need -= len(node.key)
            assert node.parent is not None, "a window span past a node detached from the tree"
            node = node.parent
        return span

    def lock_window(self, node: TreeNode) -> None:
        """Keeps the windows of the W - 1 tokens ending at node (a running request's cached end,
        locked with inc_lock_ref too) until unlock_window."""
        for n in self._window_span(node):
            if n.window_lock == 0 and n.window:
                self._window_evictable_size -= len(n.key)
            n.window_lock += 1

    def unlock_window(self, node: TreeNode) -> None:
        for n in self._window_span(node):
            if n.window_lock <= 0:
                raise RuntimeError(f"unlock_window on {n!r}, whose window is not locked")
            n.window_lock -= 1
            if n.window_lock == 0 and n.window:
                self._window_evictable_size += len(n.key)
                self._push_window(n)

    def evict_windows(self, num_tokens: int) -> int:
        """Frees at least num_tokens window slots if possible, from nodes no running request needs
        them of, least recently used first, those that end finished sequences last (mark_tail);
        their tokens stay cached, and their windows are kept in the host tier where there is room.
        Returns how many it freed."""
        assert isinstance(self.allocator, WindowedAllocator)
        freed = 0
        while freed < num_tokens and (
            (node := self._pop_lru("window")) is not None
            or (node := self._pop_lru("window_tail")) is not None
        ):
            assert node.value is not None
            self._back_up_windows(node)
            self.allocator.drop_windows(node.value)
            self._set_window(node, False)
            freed += len(node.key)
        return freed

    def _lower_windowed(self, node: TreeNode) -> bool:
        """Whether the copy that a load would bring onto the device (the host tier's where the node
        is in memory, else the disk tier's) holds the node's windows."""
        return self._host_windowed(node) if node.in_memory else self._disk_windowed(node)

    def _disk_windowed(self, node: TreeNode) -> bool:
        """Whether node's disk copy holds its windows (its entry file does)."""
        return node.disk_value is not None and self._disk_files[node.disk_value[0]].windows

    def _host_windowed(self, node: TreeNode) -> bool:
        """Whether node's host copy holds its windows (host window slots: all of its tokens or none)."""
        host = self.host_allocator
        held = isinstance(host, WindowedAllocator) and node.host_value is not None
        return held and bool(host.window_of[node.host_value[0]])  # type: ignore[union-attr,index]

    def load_windows(self, node: TreeNode) -> None:
        """Gives the nodes of the W - 1 tokens ending at node (on the device: `load` first) that have
        no windows there the windows their host copies hold, in fresh device window slots (others'
        evicted for room), so that a match can end at node. None where one of them has no windows on
        the host or no room is made: window_match then cuts the match back above them."""
        assert isinstance(self.allocator, WindowedAllocator)
        span = [n for n in self._window_span(node) if not n.window]
        if not span or not all(self._host_windowed(n) for n in span):
            return
        need = sum(len(n.key) for n in span)
        self.lock_window(node)  # so that making room takes none of the path's own windows
        try:
            short = need - self.allocator.windows.available_size()
            if short > 0:
                self.evict_windows(short)
            host = self.host_allocator
            assert isinstance(host, WindowedAllocator)
            for n in span:
                assert n.value is not None and n.host_value is not None
                # (Making room may have taken host windows too, the span's among them.)
                if not self._host_windowed(n) or not self.allocator.add_windows(n.value):
                    return
                src, dst = host.windows_of(n.host_value), self.allocator.windows_of(n.value)
                self._record("host", "device", src, dst, window=True)
                self._set_window(n, True)
                self.loaded_windows += len(dst)
        finally:
            self.unlock_window(node)

    def window_evictable_size(self) -> int:
        """Window slots the tree holds that evict_windows can free."""
        return self._window_evictable_size

    def _give_device_slots(self, node: TreeNode, slots: list[int]) -> None:
        """Puts a host-only node back on the device in `slots` (loaded, or recomputed by a caller)."""
        node.value = slots
        if node.lock_ref:
            self._protected_size += len(slots)
        else:
            self._evictable_size += len(slots)
        self._push("device", node)
        self._push("host", node)  # its copies in the lower tiers are now spare ones
        self._push("disk", node)

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
            slots = self.allocator.alloc_tokens(n)
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
                self._record("host", "device", host_node.host_value, part)
                self._give_device_slots(host_node, part)
            self.loaded_tokens += n
            return n
        finally:
            self.dec_lock_ref(node)

    def _demote(self, node: TreeNode) -> bool:
        """Keeps node's KV in a lower tier as it leaves the device: the host tier (copied there
        unless a copy is there already), else, where no child is in memory (the tiers nest), the
        disk tier. False when neither has it nor has room for it."""
        if node.host_value is not None:
            self._back_up_windows(node)
        elif not self._back_up(node):
            if any(c.in_memory for c in node.children.values()):
                return False
            if node.disk_value is None and not self._back_up_disk(node, "device"):
                return False
        node.value = None
        self._push("host", node)
        self._push("disk", node)
        return True

    def _back_up(self, node: TreeNode) -> bool:
        """Copies a device node's KV to fresh host slots, and its windows to host window slots where
        it has them and the host tier has as many free; False when the host tier has no room."""
        assert node.value is not None and node.host_value is None
        host = self._alloc("host", len(node.key))
        if host is None:
            return False
        self._record("device", "host", node.value, host)
        node.host_value = host
        self._back_up_windows(node)
        self._host_size += len(host)
        self.stored_tokens += len(host)
        self._push("host", node)
        return True

    def _back_up_windows(self, node: TreeNode) -> None:
        """Keeps the windows of a device node within a window before a sequence's end (window_tail:
        where later requests' matches end) in the host tier as they leave the device, with a copy of
        its tokens unless one is there; others' host windows go, least recently used first, for room.
        Windows inside cached sequences are not kept: no request ends there."""
        host = self.host_allocator
        src = self._src_windows(node, "device")
        if src is None or not isinstance(host, WindowedAllocator) or self._host_windowed(node):
            return
        if node.host_value is None:
            self._back_up(node)  # which comes back here with the host copy
            return
        if self._add_host_windows(node):
            dst = host.windows_of(node.host_value)
            self._record("device", "host", src, dst, window=True)
            self.stored_windows += len(dst)

    def _add_host_windows(self, node: TreeNode) -> bool:
        """Gives node's host copy host window slots, the least recently used other host windows let
        go for room; False where there is not enough room."""
        host = self.host_allocator
        assert isinstance(host, WindowedAllocator) and node.host_value is not None
        need = len(node.host_value) - host.windows.available_size()
        while need > 0 and (victim := self._pop_lru("host_window")) is not None:
            assert victim.host_value is not None
            host.drop_windows(victim.host_value)
            need -= len(victim.host_value)
        if not host.add_windows(node.host_value):
            return False
        self._push("host_window", node)
        return True

    def _is_host_window_candidate(self, node: TreeNode) -> bool:
        """A node in the tree whose host copy holds its windows."""
        return node.parent is not None and self._host_windowed(node)

    def _alloc(self, tier: Tier, n: int) -> list[int] | None:
        """n fresh slots of the host or disk tier, its least recently used entries evicted for room;
        None where there is no such tier or no room in it."""
        allocator = self.host_allocator if tier == "host" else self.disk_allocator
        if allocator is None or n > allocator.size:
            return None
        if tier == "disk":
            self._evict_disk(n)
        elif n > allocator.available_size():
            self._evict_host(n - allocator.available_size())
        return allocator.alloc_tokens(n)

    def _evict_host(self, num_tokens: int) -> None:
        """Frees host slots, least recently used first: spare copies of nodes on the device, and
        the last in-memory copies of nodes with no child in memory, which go to the disk tier where
        it takes them (or hold a copy there already) and leave the tree otherwise."""
        freed = 0
        while freed < num_tokens and (node := self._pop_lru("host")) is not None:
            assert node.host_value is not None
            freed += len(node.host_value)
            self.host_evicted_tokens += len(node.host_value)
            parent = node.parent
            assert parent is not None
            if node.on_device:
                self._free_host(node)
            elif node.disk_value is not None or self._back_up_disk(node, "host"):
                self._free_host(node)
                self._push("host", parent)
                self._push("disk", node)
            else:
                self._drop(node)
                self._push("host", parent)
                self._push("disk", parent)

    @staticmethod
    def _is_host_candidate(node: TreeNode) -> bool:
        """A node in the tree with a host copy that is spare (the node is on the device too), or
        the only in-memory copy of an unlocked node with no child in memory."""
        if node.host_value is None or node.parent is None:
            return False
        if node.on_device:
            return True
        return node.lock_ref == 0 and not any(c.in_memory for c in node.children.values())

    def _free_host(self, node: TreeNode) -> None:
        assert node.host_value is not None and self.host_allocator is not None
        self.host_allocator.free(node.host_value)
        self._host_size -= len(node.host_value)
        node.host_value = None

    def _drop(self, node: TreeNode) -> None:
        """Takes node (its device slots already freed by the caller, if it had any) and everything
        below it, in the lower tiers only by the tiers' invariant, out of the tree."""
        assert node.parent is not None
        del node.parent.children[node.key[0]]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n is node or not n.on_device, "a device node below one leaving the device"
            if n.host_value is not None:
                self._free_host(n)
            if n.disk_value is not None:
                self._free_disk(n)
            del self._nodes[n.id]
            n.parent = None
            stack.extend(n.children.values())

    def _record(
        self, src_tier: Tier, dst_tier: Tier, src: list[int], dst: list[int], window: bool = False
    ) -> None:
        """Appends a copy (of token slots, or with `window` of window slots) to the pending ones; a
        new batch where this one would write a slot twice. (A batch reads one tier and writes another,
        so no copy in it reads what another writes.)"""
        last = self._copies[-1] if self._copies else None
        joins = (
            isinstance(last, KVCopy)
            and last.tokens is None
            and (last.src_tier, last.dst_tier, last.window) == (src_tier, dst_tier, window)
            and self._copy_dsts.isdisjoint(dst)
        )
        if not joins or not isinstance(last, KVCopy):
            last = KVCopy(src_tier, dst_tier, window=window)
            self._copies.append(last)
            self._copy_dsts = set()
        last.src.extend(src)
        last.dst.extend(dst)
        self._copy_dsts.update(dst)

    def take_copies(self) -> list[KVCopy]:
        """The tier moves recorded since the last call, for the next step to run before its forward."""
        copies, self._copies, self._copy_dsts = self._copies, [], set()
        return copies

    # -- the disk tier -----------------------------------------------------------------------
    def fetch(self, node: TreeNode, move: Mover) -> int:
        """Reads the disk-only nodes of node's path back, from the top down, running the moves at
        once through `move` (the executor): into host slots, from where `load` brings them onto the
        device. Where the host tier cannot hold them all, each part read is loaded onto the device
        before the next is read (its host copies are then spare and give their room). A node whose
        data fails its checksum leaves the tree, with everything below it: it is recomputed, never
        served. Returns the tokens read, which are the top of the disk-only part."""
        total = 0
        while True:
            if total:
                _, memory_node = self.disk_suffix(node)
                # Locked so that making room on the device takes nothing of the path below.
                self.inc_lock_ref(node)
                loaded = self.load(memory_node)
                self.dec_lock_ref(node)
                if not loaded:
                    break
            got = self._fetch_to_host(node, move)
            total += got
            if not got or node.parent is None or not self.disk_suffix(node)[0]:
                break
        return total

    def _fetch_to_host(self, node: TreeNode, move: Mover) -> int:
        """One part of `fetch`: as many disk-only nodes of node's path as the host tier has room
        for, read into it."""
        if self.disk_suffix(node)[0] == 0:
            return 0
        path: list[TreeNode] = []
        walk = node
        while not walk.in_memory and walk is not self.root_node:
            path.append(walk)
            assert walk.parent is not None
            walk = walk.parent
        # Each node read with the disk slots it is read from: making room for the next one may let go
        # of a node's disk copy, spare once it has host slots (the read runs first: it is recorded
        # first).
        fetched: list[tuple[TreeNode, list[int]]] = []
        # Locked while making room in the host tier: that must take no part of this path.
        self.inc_lock_ref(node)
        try:
            for disk_node in reversed(path):
                host = self._alloc("host", len(disk_node.key))
                if host is None:
                    break
                assert disk_node.disk_value is not None
                self._record("disk", "host", disk_node.disk_value, host)
                disk_node.host_value = host
                self._host_size += len(host)
                host_windows = self.host_allocator
                if (
                    isinstance(host_windows, WindowedAllocator)
                    and self._disk_windowed(disk_node)
                    and self._add_host_windows(disk_node)
                ):
                    windows = host_windows.windows_of(host)
                    self._record("disk", "host", disk_node.disk_value, windows, window=True)
                fetched.append((disk_node, disk_node.disk_value))
        finally:
            self.dec_lock_ref(node)
        if not fetched:
            return 0
        failed = set(move(self.take_copies()))
        got = 0
        for disk_node, read_from in fetched:
            if disk_node.parent is None:
                continue  # left the tree below a node that failed
            if failed.isdisjoint(read_from):
                got += len(disk_node.key)
                if self._host_windowed(disk_node):
                    self.disk_loaded_windows += len(disk_node.key)
                self._push("host", disk_node)
                self._push("disk", disk_node)
                continue
            self.disk_failed_tokens += len(disk_node.key)
            parent = disk_node.parent
            self._drop(disk_node)
            self._push("host", parent)
            self._push("disk", parent)
        self.disk_loaded_tokens += got
        return got

    def restore(self, entries: Iterable[DiskEntry]) -> None:
        """Rebuilds the disk tier of a fresh tree from the entries the executor found on disk at
        start: each becomes a disk-only node under the path its tokens name. An entry whose path
        above it is in no entry is dropped (unreachable), and so are tokens another entry holds,
        except that an entry with windows takes its tokens over from one without (the end of a
        sequence written again with its windows, mark_tail: the earlier entry's rows are dead)."""
        assert self.disk_allocator is not None and self.num_nodes() == 1, "restore into a fresh tree"
        # By where their tokens start (an entry's path above it is in entries that start before it),
        # those with windows after those without at one start.
        entries = sorted(entries, key=lambda e: (len(e.tokens) - len(e.slots), e.windows))
        self.disk_allocator.claim([s for e in entries for s in e.slots])
        for entry in entries:
            slots, tokens = list(entry.slots), list(entry.tokens)
            # The slots its header costs: the executor kept only the entries whose whole cost fits.
            windows = entry.windows and self.window > 0
            header = self.disk_allocator.alloc(self._disk_cost(len(slots), len(tokens), windows) - len(slots))
            assert header is not None, "restored entries cost more than the disk tier holds"
            self._hold_disk_file(slots, header, windows)
            start = len(tokens) - len(slots)
            length, node = self.match_node(tokens)
            if length < start:
                self._release_disk(slots)
                continue
            if windows and length > start:
                self._take_over_disk(tokens, start, length, slots)
            else:
                self._release_disk(slots[: length - start])
            if length < len(tokens):
                leaf = TreeNode(tokens[length:], None, node, self._tick())
                leaf.disk_value = slots[length - start :]
                leaf.window_tail = windows  # (only the ends of sequences are written with windows)
                node.children[tokens[length]] = leaf
                self._nodes[leaf.id] = leaf
                self._push("disk", leaf)

    def _take_over_disk(self, tokens: list[int], start: int, length: int, slots: list[int]) -> None:
        """Restoring an entry with windows whose tokens [start, length) of `tokens` are held already:
        the nodes holding them without windows take its disk slots (and theirs are let go)."""
        _, top = self.match_node(tokens[:start])  # a node ends at `start`
        walk = self.match_node(tokens[:length])[1]
        end = length
        while walk is not top:
            assert walk.parent is not None and walk.disk_value is not None
            mine = slots[end - len(walk.key) - start : end - start]
            end -= len(walk.key)
            if self._disk_windowed(walk):
                self._release_disk(mine)
            else:
                self._release_disk(walk.disk_value)
                walk.disk_value = mine
                walk.window_tail = True
            walk = walk.parent

    def persist(self) -> int:
        """Writes every node held only in memory to the disk tier, parents first, as far as its free
        slots go (nothing on disk is evicted for it): what a server still holds in memory when it
        shuts down, for the next start. A node that does not fit is skipped with everything below
        it, which a restart could not reach. Returns the tokens written."""
        assert self.disk_allocator is not None
        written = 0
        # Each node with the length of its path, which its entry's header holds.
        queue = deque((c, len(c.key)) for c in self.root_node.children.values())
        while queue:
            node, path_len = queue.popleft()
            if node.disk_value is None:
                windows = self._src_windows(node, "device" if node.on_device else "host") is not None
                if self._disk_cost(len(node.key), path_len, windows) > self.disk_allocator.available_size():
                    continue
                self._back_up_disk(node, "device" if node.on_device else "host")
                written += len(node.key)
            queue.extend((c, path_len + len(c.key)) for c in node.children.values())
        return written

    def _back_up_disk(self, node: TreeNode, src_tier: Tier) -> bool:
        """Writes a node's KV from the device or the host tier to fresh disk slots (one entry, with
        its path's tokens, and its windows where it ends a sequence and that tier holds them); False
        when there is no disk tier or no room in it."""
        src = node.value if src_tier == "device" else node.host_value
        assert src is not None and node.disk_value is None
        path = self.path_key(node)
        n = len(node.key)
        windows = self._src_windows(node, src_tier)
        slots = self._alloc("disk", self._disk_cost(n, len(path), windows is not None))
        if slots is None:
            return False
        disk = slots[:n]
        self._hold_disk_file(disk, slots[n:], windows is not None)
        self._copies.append(KVCopy(src_tier, "disk", list(src), disk, path, windows=windows))
        node.disk_value = disk
        self.disk_stored_tokens += len(disk)
        self.disk_stored_windows += len(windows or ())
        self._push("disk", node)
        return True

    def _src_windows(self, node: TreeNode, src_tier: Tier) -> list[int] | None:
        """The window slots in src_tier of a node within a window before a sequence's end, which its
        disk entry stores beside its tokens; None where it has none there or is no such node."""
        if not node.window_tail:
            return None
        if src_tier == "device":
            held, allocator, slots = node.window, self.allocator, node.value
        else:
            held, allocator, slots = self._host_windowed(node), self.host_allocator, node.host_value
        if not held or not isinstance(allocator, WindowedAllocator) or slots is None:
            return None
        return allocator.windows_of(slots)

    def _evict_disk(self, num_slots: int) -> None:
        """Lets go of disk copies, least recently used first (spare copies of nodes in memory, and
        disk-only leaves, which leave the tree), until num_slots disk slots are free: an entry's
        slots are free once none of its tokens is held."""
        assert self.disk_allocator is not None
        free = self.disk_allocator.available_size
        while free() < num_slots and (node := self._pop_lru("disk")) is not None:
            assert node.disk_value is not None and node.parent is not None
            self.disk_evicted_tokens += len(node.disk_value)
            if node.in_memory:
                self._free_disk(node)
            else:
                parent = node.parent
                self._drop(node)
                self._push("disk", parent)
                self._push("host", parent)

    @staticmethod
    def _is_disk_candidate(node: TreeNode) -> bool:
        """A node in the tree with a disk copy that is spare (the node is in memory too), or the
        only copy of an unlocked leaf."""
        if node.disk_value is None or node.parent is None:
            return False
        return node.in_memory or (node.lock_ref == 0 and not node.children)

    def _free_disk(self, node: TreeNode) -> None:
        assert node.disk_value is not None
        self._release_disk(node.disk_value)
        node.disk_value = None

    def _hold_disk_file(self, slots: list[int], header: list[int], windows: bool = False) -> None:
        """Counts disk slots as held by nodes, in one entry file that also costs `header` slots (its
        header's bytes, and its window rows' where it holds windows)."""
        file = _DiskFile(len(slots), slots + header, windows)
        for s in slots:
            self._disk_files[s] = file
        self._disk_size += len(slots)

    def _release_disk(self, slots: list[int]) -> None:
        """Lets go of disk slots held by nodes and tells the executor to let go of their data; the
        slots of an entry file none of whose tokens is held any more return to the free list."""
        if not slots:
            return
        assert self.disk_allocator is not None
        for s in slots:
            file = self._disk_files.pop(s)
            file.live -= 1
            if file.live == 0:
                self.disk_allocator.free(file.slots)
        self._disk_size -= len(slots)
        last = self._copies[-1] if self._copies else None
        if last is not None and last.dst_tier is None:
            last.src.extend(slots)
        else:
            self._copies.append(KVCopy("disk", None, list(slots)))

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

    def disk_size(self) -> int:
        """Disk tier slots the tree holds."""
        return self._disk_size

    def reset(self) -> None:
        """Returns every cached slot of every tier to its allocator (the disk tier's data is let
        go too); refuses while a request still pins a path. Pending copies stay queued: they only
        write slots that are free now."""
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} tokens still locked")
        values: list[int] = []
        host: list[int] = []
        disk: list[int] = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            values.extend(node.value or ())
            host.extend(node.host_value or ())
            disk.extend(node.disk_value or ())
            stack.extend(node.children.values())
            node.parent = None
        self.allocator.free(values)
        if self.host_allocator is not None:
            self.host_allocator.free(host)
        self._release_disk(disk)
        self.root_node.children = {}
        self._nodes = {self.root_node.id: self.root_node}
        self._heaps = {tier: [] for tier in self._heaps}
        self._evictable_size = self._host_size = self._window_evictable_size = 0

    def pretty_print(self) -> str:
        lines = [
            f"RadixCache total={self.total_size()} evictable={self._evictable_size} "
            f"protected={self._protected_size} host={self._host_size} disk={self._disk_size}"
        ]
        stack: list[tuple[TreeNode, int]] = [
            (c, 1) for c in sorted(self.root_node.children.values(), key=lambda c: c.key[0], reverse=True)
        ]
        while stack:
            node, depth = stack.pop()
            lines.append(
                f"{'  ' * depth}key={node.key} value={node.value} host={node.host_value} "
                f"disk={node.disk_value} lock_ref={node.lock_ref} t={node.last_access_time:g}"
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
