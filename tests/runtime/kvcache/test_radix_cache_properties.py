"""Stateful property test: RadixCache + TokenAllocator driven the way the scheduler drives them.

The model is a dict from every cached prefix (tuple of tokens) to the KV slot of its last token,
plus what callers hold outside the tree: running requests (their locked prefix node and their own
fresh slots) and bare locks. After every step the tree must agree with the model and every slot in
1..size must be in exactly one place: the allocator's free list, the tree, or a caller.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm_runtime.kvcache import RadixCache, TokenAllocator, TreeNode

Prefix = tuple[int, ...]

# The binary-alphabet half makes shared prefixes (and so splits and duplicate inserts) common.
keys = st.lists(st.integers(min_value=0, max_value=3), max_size=8) | st.lists(
    st.integers(min_value=0, max_value=1), max_size=8
)


@dataclass
class Request:
    """A running request: its matched prefix is locked, the rest of value is its own fresh slots."""

    key: list[int]
    value: list[int]
    prefix_len: int
    node: TreeNode


def _tree_contents(cache: RadixCache) -> dict[Prefix, int]:
    """Walks the tree checking its structure, and returns prefix -> slot for every cached token."""
    out: dict[Prefix, int] = {}
    stack: list[tuple[TreeNode, Prefix]] = [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node
            assert len(child.key) > 0 and child.key[0] == first
            assert isinstance(child.value, list) and all(type(s) is int for s in child.value)
            assert len(child.value) == len(child.key)
            assert 0 <= child.lock_ref <= node.lock_ref or node is cache.root_node
            path = prefix
            for tok, slot in zip(child.key, child.value, strict=True):
                path = (*path, tok)
                out[path] = slot
            stack.append((child, path))
    return out


def _lru_eviction(cache: RadixCache, n: int) -> set[Prefix]:
    """The cached token prefixes evict(n) must take, by the definition: repeatedly the unlocked leaf
    least recently used (creation order breaking ties) until n tokens are freed, a parent whose last
    child went joining the candidates. Computed from a walk of the tree, as evict did before it kept
    its candidates in a heap."""
    children: dict[int, int] = {}
    parent_of: dict[int, TreeNode] = {}
    paths: dict[int, Prefix] = {}
    heap: list[tuple[float, int, TreeNode]] = []
    stack: list[tuple[TreeNode, Prefix]] = [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        children[node.id] = len(node.children)
        for child in node.children.values():
            path = (*prefix, *child.key)
            parent_of[child.id], paths[child.id] = node, path
            if not child.children and child.lock_ref == 0:
                heap.append((child.last_access_time, child.id, child))
            stack.append((child, path))
    heapq.heapify(heap)
    taken: set[Prefix] = set()
    freed = 0
    while freed < n and heap:
        _, _, node = heapq.heappop(heap)
        path = paths[node.id]
        taken.update(path[: len(path) - len(node.key) + i + 1] for i in range(len(node.key)))
        freed += len(node.key)
        parent = parent_of[node.id]
        children[parent.id] -= 1
        if parent is not cache.root_node and children[parent.id] == 0 and parent.lock_ref == 0:
            heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
    return taken


def _is_attached(cache: RadixCache, node: TreeNode) -> bool:
    while node is not cache.root_node:
        parent = node.parent
        if parent is None or parent.children.get(node.key[0]) is not node:
            return False
        node = parent
    return True


class RadixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model: dict[Prefix, int] = {}
        self.requests: list[Request] = []
        self.locks: list[TreeNode] = []

    @initialize(size=st.sampled_from([16, 64]))
    def setup(self, size: int) -> None:
        self.alloc = TokenAllocator(size)
        self.cache = RadixCache(self.alloc)

    def _expected_match(self, key: list[int]) -> list[int]:
        slots: list[int] = []
        for i in range(len(key)):
            slot = self.model.get(tuple(key[: i + 1]))
            if slot is None:
                break
            slots.append(slot)
        return slots

    def _locked_slots(self) -> set[int]:
        return {slot for path, slot in self._tree().items() if self._lock_count(path) > 0}

    def _lock_count(self, path: Prefix) -> int:
        held = [self._path_of(r.node) for r in self.requests] + [self._path_of(n) for n in self.locks]
        return sum(1 for p in held if p[: len(path)] == path)

    def _path_of(self, node: TreeNode) -> Prefix:
        parts: list[list[int]] = []
        while node is not self.cache.root_node:
            parts.append(node.key)
            assert node.parent is not None
            node = node.parent
        return tuple(tok for part in reversed(parts) for tok in part)

    def _tree(self) -> dict[Prefix, int]:
        return _tree_contents(self.cache)

    def _evict_for(self, n: int) -> None:
        """What the scheduler does when the pool is short: evict, then check what went."""
        short = n - self.alloc.available_size()
        if short > 0:
            self.do_evict(short)

    @rule(key=keys)
    def match(self, key: list[int]) -> None:
        value, node = self.cache.match_prefix(key)
        assert value == self._expected_match(key)
        assert self._path_of(node) == tuple(key[: len(value)])
        # match_node finds the same node (already split by the match above) without gathering slots,
        # and path_slots gathers exactly them.
        length, same = self.cache.match_node(key)
        assert length == len(value) and same is node
        assert self.cache.path_slots(node) == value

    @rule(key=keys)
    def start_request(self, key: list[int]) -> None:
        req = self._start(key)
        if req is not None:
            self.requests.append(req)

    def _start(self, key: list[int]) -> Request | None:
        prefix, node = self.cache.match_prefix(key)
        assert prefix == self._expected_match(key)
        self.cache.inc_lock_ref(node)
        need = len(key) - len(prefix)
        self._evict_for(need)
        fresh = self.alloc.alloc(need)
        if fresh is None:
            assert self.alloc.available_size() < need
            self.cache.dec_lock_ref(node)
            return None
        # The locked prefix must have survived the eviction made for this very request.
        assert self.cache.match_prefix(key)[0][: len(prefix)] == prefix
        assert self.cache.path_slots(node) == prefix
        return Request(key, prefix + fresh, len(prefix), node)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        self._finish(self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1))))

    @rule(key=keys)
    def run_request(self, key: list[int]) -> None:
        """A request that starts and finishes in one step, so the tree fills up often enough to evict."""
        req = self._start(key)
        if req is not None:
            self._finish(req)

    def _finish(self, req: Request) -> None:
        cached = self.cache.insert(req.key, req.value)
        assert cached >= req.prefix_len
        assert cached == len(self._expected_match(req.key))
        # Slots past our locked prefix that another request cached meanwhile are duplicates: free ours.
        self.alloc.free(req.value[req.prefix_len : cached])
        for i in range(len(req.key)):
            path = tuple(req.key[: i + 1])
            if i < req.prefix_len:
                assert self.model[path] == req.value[i]
            elif i >= cached:
                assert path not in self.model
                self.model[path] = req.value[i]
        self.cache.dec_lock_ref(req.node)
        got, node = self.cache.match_prefix(req.key)
        assert len(got) == len(req.key)
        assert got == [self.model[tuple(req.key[: i + 1])] for i in range(len(req.key))]
        assert self._path_of(node) == tuple(req.key)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_request(self, data: st.DataObject) -> None:
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.alloc.free(req.value[req.prefix_len :])
        self.cache.dec_lock_ref(req.node)

    @rule(key=keys)
    def lock(self, key: list[int]) -> None:
        # The scheduler pins a waiting request's prefix through match_node (no slots gathered).
        length, node = self.cache.match_node(key)
        assert length == len(self._expected_match(key))
        assert self._path_of(node) == tuple(key[:length])
        self.cache.inc_lock_ref(node)
        self.locks.append(node)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(min_value=0, max_value=20))
    def do_evict(self, n: int) -> None:
        before = self._tree()
        locked = self._locked_slots()
        evictable = self.cache.evictable_size()
        available = self.alloc.available_size()
        expected = _lru_eviction(self.cache, n)
        freed = self.cache.evict(n)
        after = self._tree()
        assert all(before.get(path) == slot for path, slot in after.items())
        removed = {path: slot for path, slot in before.items() if path not in after}
        assert freed == len(removed)
        assert self.alloc.available_size() == available + freed
        assert freed >= min(n, evictable)
        assert not locked & set(removed.values())
        assert set(removed) == expected, "evict did not take the least recently used leaves"
        for path in removed:
            del self.model[path]

    @precondition(lambda self: not self.requests and not self.locks)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.model.clear()
        assert self.alloc.available_size() == self.alloc.size

    @invariant()
    def tree_matches_model(self) -> None:
        assert self._tree() == self.model

    @invariant()
    def slots_are_partitioned(self) -> None:
        free = self.alloc.alloc(self.alloc.available_size())
        assert free is not None
        self.alloc.free(free)
        free_slots = free
        tree_slots = list(self.model.values())
        caller_slots = [s for r in self.requests for s in r.value[r.prefix_len :]]
        everything = free_slots + tree_slots + caller_slots
        assert len(everything) == len(set(everything)), "a slot is in two places"
        assert set(everything) == set(range(1, self.alloc.size + 1)), "a slot leaked"

    @invariant()
    def counters_are_consistent(self) -> None:
        total = len(self.model)
        locked = len(self._locked_slots())
        assert self.cache.total_size() == total
        assert self.cache.protected_size() == locked
        assert self.cache.evictable_size() + self.cache.protected_size() == total
        if not self.requests:
            assert self.alloc.available_size() + total == self.alloc.size

    @invariant()
    def lock_refs_count_the_holders(self) -> None:
        assert self.cache.root_node.lock_ref == 1
        for node in self.locks + [r.node for r in self.requests]:
            assert _is_attached(self.cache, node)
        stack = list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            assert node.lock_ref == self._lock_count(self._path_of(node))
            stack.extend(node.children.values())

    @invariant()
    def every_node_is_found_by_id(self) -> None:
        nodes = [self.cache.root_node]
        stack = list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        assert self.cache.num_nodes() == len(nodes)
        assert all(self.cache.node(n.id) is n for n in nodes)


RadixCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheMachine = RadixCacheMachine.TestCase
