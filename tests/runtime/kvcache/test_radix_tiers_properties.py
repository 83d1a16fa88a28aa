"""Stateful property test of the radix cache with a host tier, driven the way CacheManager drives it.

Beside the tree, the test keeps the KV itself: a device memory and a host memory of "contents", one
per slot, where a computed token's content names its whole prefix. Copies the tree records are run
in order before each step's "forward" (which writes the new tokens' contents), as the executor
runs them. After every step: each cached token's content, in whichever tiers hold it, is the one
written for its prefix (a loaded prefix is bit-identical to what was stored, nothing stale is
served); every slot of each tier is in exactly one place; the counters count the device tier.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm_runtime.kvcache import RadixCache, TokenAllocator, TreeNode

Prefix = tuple[int, ...]

keys = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=8) | st.lists(
    st.integers(min_value=0, max_value=1), min_size=1, max_size=8
)


def _nodes(cache: RadixCache) -> list[tuple[TreeNode, Prefix]]:
    """Every node but the root with the token prefix its edge ends at."""
    out: list[tuple[TreeNode, Prefix]] = []
    stack: list[tuple[TreeNode, Prefix]] = [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            path = (*prefix, *child.key)
            out.append((child, path))
            stack.append((child, path))
    return out


class TieredCacheMachine(RuleBasedStateMachine):
    @initialize(
        size=st.sampled_from([12, 24]), host=st.sampled_from([8, 16, 48]), write_through=st.booleans()
    )
    def setup(self, size: int, host: int, write_through: bool) -> None:
        self.alloc = TokenAllocator(size)
        self.host_alloc = TokenAllocator(host)
        self.cache = RadixCache(self.alloc, self.host_alloc, write_through)
        self.device: list[Prefix | None] = [None] * (size + 1)
        self.host: list[Prefix | None] = [None] * (host + 1)
        self.loaded = 0

    def _run_copies(self) -> None:
        for copy in self.cache.take_copies():
            assert len(copy.dst) == len(set(copy.dst)), "a batch writes a slot twice"
            src_mem, dst_mem = (self.device, self.host) if copy.to_host else (self.host, self.device)
            values = [src_mem[s] for s in copy.src]
            for d, v in zip(copy.dst, values, strict=True):
                dst_mem[d] = v

    @rule(key=keys)
    def run_request(self, key: list[int]) -> None:
        """Admission (match, load the host part or fall back to the device part, lock), the step's
        copies, a forward writing the new tokens, insertion and release, as one request does."""
        length, node = self.cache.match_node(key)
        host_len, device_node = self.cache.host_suffix(node)
        if host_len:
            if self.cache.load(node):
                self.loaded += host_len
            else:
                length, node = length - host_len, device_node
        self.cache.inc_lock_ref(node)
        prefix = self.cache.path_slots(node) if length else []
        assert len(prefix) == length
        need = len(key) - length
        short = need - self.alloc.available_size()
        if short > 0:
            self.cache.evict(short)
        fresh = self.alloc.alloc(need)
        self._run_copies()
        # The loaded and matched prefix reads exactly what was written for it.
        assert [self.device[s] for s in prefix] == [tuple(key[: i + 1]) for i in range(length)]
        if fresh is None:
            self.cache.dec_lock_ref(node)
            return
        for i, slot in enumerate(fresh):
            self.device[slot] = tuple(key[: length + i + 1])
        value = prefix + fresh
        already = self.cache.insert(key, value)
        self.alloc.free(value[length:already])
        self.cache.dec_lock_ref(node)
        self._run_copies()

    @rule(key=keys)
    def match(self, key: list[int]) -> None:
        length, node = self.cache.match_node(key)
        host_len, device_node = self.cache.host_suffix(node)
        assert 0 <= host_len <= length
        slots = self.cache.path_slots(device_node)
        assert len(slots) == length - host_len

    @rule(n=st.integers(min_value=1, max_value=16))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_size()
        available = self.alloc.available_size()
        freed = self.cache.evict(n)
        assert freed >= min(n, evictable)
        assert self.alloc.available_size() == available + freed
        self._run_copies()

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        assert self.alloc.available_size() == self.alloc.size
        assert self.host_alloc.available_size() == self.host_alloc.size
        assert self.cache.host_size() == 0 and self.cache.num_nodes() == 1

    @precondition(lambda self: self.loaded)
    @invariant()
    def loads_are_counted(self) -> None:
        assert self.cache.loaded_tokens == self.loaded

    @invariant()
    def every_copy_holds_its_prefix(self) -> None:
        for node, path in _nodes(self.cache):
            start = len(path) - len(node.key)
            want = [path[: start + i + 1] for i in range(len(node.key))]
            assert node.value is not None or node.host_value is not None, "a node in no tier"
            if node.value is not None:
                assert [self.device[s] for s in node.value] == want
            if node.host_value is not None:
                assert [self.host[s] for s in node.host_value] == want

    @invariant()
    def tiers_nest(self) -> None:
        """The device tier is prefix-closed: a node on the device has its parent on the device."""
        for node, _ in _nodes(self.cache):
            assert node.parent is not None
            if node.on_device:
                assert node.parent.on_device

    @invariant()
    def slots_are_partitioned(self) -> None:
        nodes = [n for n, _ in _nodes(self.cache)]
        for alloc, tree_slots in (
            (self.alloc, [s for n in nodes for s in n.value or ()]),
            (self.host_alloc, [s for n in nodes for s in n.host_value or ()]),
        ):
            free = alloc.alloc(alloc.available_size())
            assert free is not None
            alloc.free(free)
            everything = free + tree_slots
            assert len(everything) == len(set(everything)), "a slot is in two places"
            assert set(everything) == set(range(1, alloc.size + 1)), "a slot leaked"

    @invariant()
    def counters_count_the_device_tier(self) -> None:
        nodes = [n for n, _ in _nodes(self.cache)]
        assert self.cache.total_size() == sum(len(n.key) for n in nodes if n.on_device)
        assert self.cache.protected_size() == 0  # nothing holds a lock between steps
        assert self.cache.host_size() == sum(len(n.host_value or ()) for n in nodes)
        assert self.cache.num_nodes() == len(nodes) + 1
        assert all(self.cache.node(n.id) is n for n in nodes)


TieredCacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieredCacheMachine = TieredCacheMachine.TestCase
