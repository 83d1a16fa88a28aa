"""The radix tree over a windowed pool (kvcache/radix_cache.py, "Windows"): matches cut back to an end
whose window is held, window locks, least-recently-used window eviction that keeps the tokens, and
a stateful property test of the accounting: every window slot is free, held by a tree node (all of
its tokens or none) or by a caller, and the evictable count is exactly what evict_windows can free."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm_runtime.kvcache import RadixCache, TreeNode
from radixlm_runtime.kvcache.allocator import WindowedAllocator

W = 4  # a query sees itself and the 3 tokens before it


def _insert(cache: RadixCache, alloc: WindowedAllocator, key: list[int], trim: int = 0) -> list[int]:
    """Inserts key in fresh slots whose first `trim` had their windows dropped (as a request's own
    tokens out of its window)."""
    slots = alloc.alloc(len(key))
    assert slots is not None
    alloc.drop_windows(slots[:trim])
    already = cache.insert(key, slots)
    alloc.free(slots[:already])
    return slots


def _windowed_cache(size: int = 64, windows: int = 64) -> tuple[RadixCache, WindowedAllocator]:
    alloc = WindowedAllocator(size, windows)
    return RadixCache(alloc, window=W), alloc


def test_insert_keeps_windows_only_where_the_caller_has_them() -> None:
    cache, alloc = _windowed_cache()
    _insert(cache, alloc, list(range(10)), trim=6)
    length, node = cache.match_node(list(range(10)))
    assert length == 10 and node.window and len(node.key) == 4
    assert node.parent is not None and not node.parent.window and len(node.parent.key) == 6
    assert alloc.windows.available_size() == 64 - 4
    assert cache.window_evictable_size() == 4


def test_match_is_cut_back_to_an_end_whose_window_is_held() -> None:
    cache, alloc = _windowed_cache()
    _insert(cache, alloc, list(range(10)), trim=6)
    # Positions 6-9 hold windows: an end at 10 or 9 has its 3 tokens before it; one at 8 does not
    # (position 5), nor any before.
    assert cache.window_match(*cache.match_node(list(range(10))))[0] == 10
    assert cache.window_match(*cache.match_node(list(range(9))))[0] == 9
    assert cache.window_match(*cache.match_node(list(range(8))))[0] == 0
    # A prefix shorter than the window is whole only if every token of it has its window.
    cache2, alloc2 = _windowed_cache()
    _insert(cache2, alloc2, [1, 2, 3])
    assert cache2.window_match(*cache2.match_node([1, 2, 3]))[0] == 3


def test_evict_windows_takes_the_least_recent_unlocked_and_keeps_the_tokens() -> None:
    cache, alloc = _windowed_cache()
    _insert(cache, alloc, [1, 1, 1, 1, 1])
    _insert(cache, alloc, [2, 2, 2, 2, 2])
    length, node = cache.match_node([2, 2, 2, 2, 2])
    cache.inc_lock_ref(node)
    cache.lock_window(node)
    assert cache.evict_windows(1) == 5  # the [1...] leaf, whole: the [2...] one's last 3 are locked
    assert cache.match_node([1, 1, 1, 1, 1])[0] == 5  # tokens still cached
    assert cache.window_match(*cache.match_node([1, 1, 1, 1, 1]))[0] == 0
    assert cache.evict_windows(10) == 2  # only [2, 2] above the locked window
    cache.unlock_window(node)
    cache.dec_lock_ref(node)
    assert cache.window_evictable_size() == 3
    cache.evict(10)
    assert alloc.available_size() == 64 and alloc.windows.available_size() == 64


def test_a_duplicate_insert_gives_the_tree_the_callers_windows() -> None:
    cache, alloc = _windowed_cache()
    _insert(cache, alloc, list(range(8)))
    assert cache.evict_windows(8) == 8
    # The same tokens computed again by a caller that kept windows for its last 3.
    slots = alloc.alloc(8)
    assert slots is not None
    alloc.drop_windows(slots[:5])
    assert cache.insert(list(range(8)), slots) == 8
    alloc.free(slots)
    assert cache.window_match(*cache.match_node(list(range(8))))[0] == 8
    assert alloc.windows.available_size() == 64 - 3


def test_a_windowed_tree_refuses_a_plain_allocator_or_a_host_tier() -> None:
    from radixlm_runtime.kvcache import TokenAllocator

    with pytest.raises(ValueError, match="WindowedAllocator"):
        RadixCache(TokenAllocator(8), window=W)
    with pytest.raises(ValueError, match="host tier"):
        RadixCache(WindowedAllocator(8, 8), TokenAllocator(8), window=W)


keys = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=10)


class WindowMachine(RuleBasedStateMachine):
    """Requests admitted on window-cut matches with their windows locked, fresh tokens computed with
    their front trimmed, finished into the tree; window and token eviction in between."""

    @initialize()
    def setup(self) -> None:
        self.alloc = WindowedAllocator(48, 24)
        self.cache = RadixCache(self.alloc, window=W)
        self.running: list[tuple[TreeNode, list[int]]] = []  # (locked end, own slots)
        self.key_of: dict[int, list[int]] = {}

    @rule(key=keys, trim=st.integers(min_value=0, max_value=10))
    def run_request(self, key: list[int], trim: int) -> None:
        """Admitted as the scheduler admits: the window-cut match locked, then room made for the rest."""
        length, node = self.cache.window_match(*self.cache.match_node(key))
        self.cache.inc_lock_ref(node)
        self.cache.lock_window(node)
        own = len(key) - length
        self.cache.evict(own - self.alloc.available_size())
        self.cache.evict_windows(own - self.alloc.windows.available_size())
        # The locked window is held whole: the W - 1 tokens before the end have windows.
        assert self.cache.window_match(length, node) == (length, node)
        slots = self.alloc.alloc(own)
        if slots is None:
            self.cache.unlock_window(node)
            self.cache.dec_lock_ref(node)
            return
        self.alloc.drop_windows(slots[: min(trim, max(own - (W - 1), 0))])
        self.running.append((node, slots))
        self.key_of[id(slots)] = key

    @precondition(lambda self: self.running)
    @rule(i=st.integers(min_value=0), cache_it=st.booleans())
    def finish(self, i: int, cache_it: bool) -> None:
        node, slots = self.running.pop(i % len(self.running))
        key = self.key_of.pop(id(slots))
        if cache_it:
            full = self.cache.path_slots(node) + slots
            already = self.cache.insert(key, full)
            prefix = len(full) - len(slots)
            self.alloc.free(full[prefix:already])
        else:
            self.alloc.free(slots)
        self.cache.unlock_window(node)
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(min_value=1, max_value=30))
    def evict_windows(self, n: int) -> None:
        before = self.cache.window_evictable_size()
        freed = self.cache.evict_windows(n)
        assert freed >= min(n, before) and freed <= before

    @rule(n=st.integers(min_value=1, max_value=30))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @invariant()
    def windows_accounted(self) -> None:
        window_of = self.alloc.window_of
        held = evictable = 0
        stack = list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            assert node.value is not None
            has = [bool(window_of[s]) for s in node.value]
            assert all(has) if node.window else not any(has), "a node holds some of its windows"
            if node.window:
                held += len(node.key)
                if node.window_lock == 0:
                    evictable += len(node.key)
        own = sum(bool(window_of[s]) for _, slots in self.running for s in slots)
        assert held + own + self.alloc.windows.available_size() == 24
        assert evictable == self.cache.window_evictable_size()
        in_use = [w for w in window_of if w]
        assert len(in_use) == len(set(in_use)), "a window slot given to two tokens"


WindowMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_window_machine = WindowMachine.TestCase


def test_windows_ending_finished_sequences_go_last() -> None:
    """A long sequence's own windows go before those at the end of a finished one, however recent:
    a follow-up turn matches up to the end, never into the middle."""
    cache, alloc = _windowed_cache()
    _insert(cache, alloc, [1] * 6)
    cache.mark_tail(cache.match_node([1] * 6)[1])
    _insert(cache, alloc, [2] * 10)  # more recent, but no sequence ends in it yet
    # The first three of [1] * 6 (outside its end's window), then all of [2] * 10.
    assert cache.evict_windows(5) == 13
    assert cache.window_match(*cache.match_node([1] * 6))[0] == 6
    assert cache.window_match(*cache.match_node([2] * 10))[0] == 0
    assert cache.evict_windows(5) == 3  # then the tail: [1, 1, 1], the window before its end
