"""The radix tree over a windowed pool (kvcache/radix_cache.py, "Windows"): matches cut back to an end
whose window is held, window locks, least-recently-used window eviction that keeps the tokens, and
a stateful property test of the accounting: every window slot is free, held by a tree node (all of
its tokens or none) or by a caller, and the evictable count is exactly what evict_windows can free.
With a host tier: windows at sequence ends kept there and loaded back, checked on simulated KV."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm_runtime.kvcache import RadixCache, TreeNode
from radixlm_runtime.kvcache.allocator import TokenAllocator, WindowedAllocator
from radixlm_runtime.step import DiskEntry, KVCopy

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


def test_a_windowed_tree_refuses_a_plain_allocator() -> None:
    with pytest.raises(ValueError, match="WindowedAllocator"):
        RadixCache(TokenAllocator(8), window=W)


def test_the_host_tier_keeps_windows_and_a_load_brings_back_the_ends() -> None:
    """A windowed node demoted to the host tier takes its windows there; a match through it counts
    them, and loading it back gives the W - 1 tokens before the end device windows, copied from the
    host's: token copies and window copies recorded apart."""
    alloc, host = WindowedAllocator(16, 16), WindowedAllocator(32, 8)
    cache = RadixCache(alloc, host, window=W)
    slots = _insert(cache, alloc, list(range(10)), trim=6)  # windows on the last 4
    cache.mark_tail(cache.match_node(list(range(10)))[1])  # a finished sequence's end
    windows = alloc.windows_of(slots)
    cache.take_copies()
    assert cache.evict(16) == 10
    copies = cache.take_copies()
    # The leaf of the W tokens before the end (its tokens, then its windows), then the node above it
    # (tokens only).
    assert [(c.src_tier, c.dst_tier, c.window) for c in copies] == [
        ("device", "host", False),
        ("device", "host", True),
        ("device", "host", False),
    ]
    assert sorted(copies[0].src + copies[2].src) == sorted(slots) and copies[1].src == windows[6:]
    assert host.windows.available_size() == 8 - W and alloc.windows.available_size() == 16
    # On the host only: a match may end at 10, since the host copy of its end has windows.
    assert cache.window_match(*cache.match_node(list(range(10))))[0] == 0
    length, node = cache.window_match(*cache.match_node(list(range(10))), host=True)
    assert length == 10 and cache.host_suffix(node)[0] == 10
    cache.inc_lock_ref(node)
    assert cache.load(node) == 10
    cache.load_windows(node)
    cache.dec_lock_ref(node)
    copies = cache.take_copies()
    assert [(c.src_tier, c.dst_tier, c.window) for c in copies] == [
        ("host", "device", False),
        ("host", "device", True),
    ]
    assert len(copies[0].src) == 10 and len(copies[1].src) == W - 1  # only the window before the end
    assert cache.window_match(*cache.match_node(list(range(10))))[0] == 10
    assert alloc.windows.available_size() == 16 - (W - 1)


def test_windows_evicted_from_the_pool_are_kept_in_the_host_tier() -> None:
    """Window eviction keeps the tokens on the device and the windows on the host (with a host copy
    of the tokens); a match counts them, and load_windows brings the end's back."""
    alloc, host = WindowedAllocator(16, 16), WindowedAllocator(32, 8)
    cache = RadixCache(alloc, host, window=W)
    _insert(cache, alloc, list(range(10)), trim=6)
    cache.mark_tail(cache.match_node(list(range(10)))[1])
    cache.take_copies()
    assert cache.evict_windows(16) == 4
    # The W tokens before the end, with a host copy of their tokens.
    copies = cache.take_copies()
    assert [(c.src_tier, c.dst_tier, c.window, len(c.src)) for c in copies] == [
        ("device", "host", False, W),
        ("device", "host", True, W),
    ]
    assert alloc.windows.available_size() == 16 and host.windows.available_size() == 8 - W
    assert cache.window_match(*cache.match_node(list(range(10))))[0] == 0
    length, node = cache.window_match(*cache.match_node(list(range(10))), host=True)
    assert length == 10 and cache.host_suffix(node)[0] == 0
    cache.load_windows(node)
    assert [(c.src_tier, c.dst_tier, c.window, len(c.src)) for c in cache.take_copies()] == [
        ("host", "device", True, W - 1)
    ]
    assert cache.window_match(*cache.match_node(list(range(10))))[0] == 10
    assert alloc.windows.available_size() == 16 - (W - 1)
    # A second window eviction copies nothing: the host holds those windows already.
    assert cache.evict_windows(16) == W - 1 and cache.take_copies() == []


def test_a_host_copy_without_room_for_windows_is_kept_without_them() -> None:
    alloc, host = WindowedAllocator(16, 16), WindowedAllocator(32, 2)
    cache = RadixCache(alloc, host, window=W)
    _insert(cache, alloc, list(range(10)), trim=6)
    cache.mark_tail(cache.match_node(list(range(10)))[1])
    cache.evict(16)
    assert [c.window for c in cache.take_copies()] == [False]
    assert host.windows.available_size() == 2
    # Its tokens are on the host, but no end of them can be served: recomputed.
    assert cache.match_node(list(range(10)))[0] == 10
    assert cache.window_match(*cache.match_node(list(range(10))), host=True)[0] == 0


def test_host_windows_go_least_recently_used_first_for_a_newer_end() -> None:
    """Room for one end's windows on the host: the second end demoted takes the first's."""
    alloc, host = WindowedAllocator(16, 16), WindowedAllocator(32, W)
    cache = RadixCache(alloc, host, window=W)
    for key in ([1] * 5, [2] * 5):
        _insert(cache, alloc, key)
        cache.mark_tail(cache.match_node(key)[1])
    cache.match_node([1] * 5)  # touched: [2] * 5 is the least recent now
    assert cache.evict(5) == 5
    assert cache.window_match(*cache.match_node([2] * 5), host=True)[0] == 5
    assert cache.evict(5) == 5
    assert cache.window_match(*cache.match_node([1] * 5), host=True)[0] == 5
    assert cache.window_match(*cache.match_node([2] * 5), host=True)[0] == 0
    assert host.windows.available_size() == 0


def test_a_restart_restores_an_end_written_again_with_its_windows() -> None:
    """A prompt's end inside a sequence written through without windows, then again with them once
    the sequence finished: both files are on disk at a restart (the first still holds the tokens
    around the end). Restored in either order, the end's nodes hold the second file's windows, and a
    match can end there."""
    alloc, host = WindowedAllocator(16, 16), WindowedAllocator(32, 8)

    def tiered() -> RadixCache:
        return RadixCache(
            alloc,
            host,
            disk_allocator=TokenAllocator(64),
            disk_write_through=True,
            disk_entry_cost=lambda n, _path, windows: n + (n if windows else 0),
            window=W,
        )

    cache = tiered()
    _insert(cache, alloc, list(range(10)), trim=3)  # windows on the last 7
    cache.mark_tail(cache.match_node(list(range(8)))[1])  # the prompt's end
    writes = [c for c in cache.take_copies() if c.dst_tier == "disk"]
    # The 3 tokens without windows and the 7 with (written through apart), then the W before the end.
    assert [(len(c.dst), c.windows is not None) for c in writes] == [(3, False), (7, False), (W, True)]
    entries = [DiskEntry(tuple(c.tokens or ()), tuple(c.dst), c.windows is not None) for c in writes]
    for order in (entries, entries[::-1]):
        alloc.clear()
        host.clear()
        fresh = tiered()
        fresh.restore(order)
        length, node = fresh.window_match(*fresh.match_node(list(range(8))), host=True)
        assert length == 8 and fresh.disk_suffix(node)[0] == 8
        assert fresh.match_node(list(range(10)))[0] == 10
        assert fresh.disk_size() == 10  # of the 7-token file, the W tokens the other holds let go


keys = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=10)


class WindowMachine(RuleBasedStateMachine):
    """Requests admitted on window-cut matches with their windows locked, fresh tokens computed with
    their front trimmed, finished into the tree (the end marked as a tail, as CacheManager.release
    does), follow-up turns on finished ones; window and token eviction in between."""

    TOKENS, WINDOWS = 48, 24

    @initialize()
    def setup(self) -> None:
        self.alloc = WindowedAllocator(self.TOKENS, self.WINDOWS)
        self.cache = self.new_cache()
        self.running: list[tuple[TreeNode, list[int]]] = []  # (locked end, own slots)
        self.key_of: dict[int, list[int]] = {}
        self.finished: list[list[int]] = []

    def new_cache(self) -> RadixCache:
        return RadixCache(self.alloc, window=W)

    def match(self, key: list[int]) -> tuple[int, TreeNode]:
        """Where a request for key starts computing (admission's match)."""
        return self.cache.window_match(*self.cache.match_node(key))

    def check_prefix(self, key: list[int], length: int, node: TreeNode) -> None:
        """Checks what a request admitted on key's first `length` tokens reads."""

    def compute(self, key: list[int], length: int, slots: list[int]) -> None:
        """A request's own tokens key[length:] computed into `slots`."""

    @rule(key=keys, trim=st.integers(min_value=0, max_value=10))
    def run_request(self, key: list[int], trim: int) -> None:
        """Admitted as the scheduler admits: the window-cut match locked, then room made for the rest."""
        length, node = self.match(key)
        self.cache.inc_lock_ref(node)
        self.cache.lock_window(node)
        own = len(key) - length
        self.cache.evict(own - self.alloc.available_size())
        self.cache.evict_windows(own - self.alloc.windows.available_size())
        # The locked window is held whole: the W - 1 tokens before the end have windows.
        assert self.cache.window_match(length, node) == (length, node)
        self.check_prefix(key, length, node)
        slots = self.alloc.alloc(own)
        if slots is None:
            self.cache.unlock_window(node)
            self.cache.dec_lock_ref(node)
            return
        self.compute(key, length, slots)
        self.alloc.drop_windows(slots[: min(trim, max(own - (W - 1), 0))])
        self.running.append((node, slots))
        self.key_of[id(slots)] = key

    @precondition(lambda self: self.finished)
    @rule(i=st.integers(min_value=0), more=keys, trim=st.integers(min_value=0, max_value=10))
    def follow_up(self, i: int, more: list[int], trim: int) -> None:
        """A next turn: an earlier sequence, then more tokens."""
        self.run_request(self.finished[i % len(self.finished)] + more, trim)

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
            self.cache.mark_tail(self.cache.match_node(key)[1])
            self.finished.append(key)
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
            if node.value is None:
                assert not node.window, "a node off the device holds device windows"
                continue
            has = [bool(window_of[s]) for s in node.value]
            assert all(has) if node.window else not any(has), "a node holds some of its windows"
            if node.window:
                held += len(node.key)
                if node.window_lock == 0:
                    evictable += len(node.key)
        own = sum(bool(window_of[s]) for _, slots in self.running for s in slots)
        assert held + own + self.alloc.windows.available_size() == self.WINDOWS
        assert evictable == self.cache.window_evictable_size()
        in_use = [w for w in window_of if w]
        assert len(in_use) == len(set(in_use)), "a window slot given to two tokens"


WindowMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_window_machine = WindowMachine.TestCase


class WindowTierMachine(WindowMachine):
    """The same requests over a device pool and a windowed host tier, with the KV itself simulated:
    every slot and window slot of each tier holds the path it was computed for, the tree's recorded
    copies are run before each request computes (as the executor runs them before a forward), and a
    request admitted on a match reads, through its slots, the KV of its own prefix, and through its
    window slots that of the W - 1 tokens before its end."""

    TOKENS, WINDOWS = 20, 12
    HOST_TOKENS, HOST_WINDOWS = 48, 12

    def new_cache(self) -> RadixCache:
        self.host = WindowedAllocator(self.HOST_TOKENS, self.HOST_WINDOWS)
        # tier -> (token slot -> path, window slot -> path); the disk's window rows are its slots'.
        self.kv: dict[str, tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]] = {
            "device": ({}, {}),
            "host": ({}, {}),
            "disk": ({}, {}),
        }
        return RadixCache(self.alloc, self.host, window=W)

    def move(self, copies: list[KVCopy]) -> list[int]:
        """Runs recorded moves on the simulated KV, in order (the executor's KVTiers.run)."""
        for c in copies:
            if c.dst_tier is None:
                continue  # disk slots let go
            src = self.kv[c.src_tier]
            reads = [src[c.window][s] for s in c.src]  # a batch reads before it writes
            self.kv[c.dst_tier][c.window].update(zip(c.dst, reads, strict=True))
            if c.windows is not None:  # a disk entry's window rows
                self.kv["disk"][True].update(zip(c.dst, [src[True][w] for w in c.windows], strict=True))
        return []

    def match(self, key: list[int]) -> tuple[int, TreeNode]:
        """As CacheManager.admit: matched counting host windows, the host part loaded, the end's
        windows loaded, the match cut to an end with windows on the device."""
        length, node = self.cache.window_match(*self.cache.match_node(key), host=True)
        host_len, device_node = self.cache.host_suffix(node)
        if host_len and not self.cache.load(node):
            length, node = length - host_len, device_node
        self.cache.load_windows(node)
        return self.cache.window_match(length, node)

    def check_prefix(self, key: list[int], length: int, node: TreeNode) -> None:
        self.move(self.cache.take_copies())
        tokens, windows = self.kv["device"]
        path = self.cache.path_slots(node)
        for i, s in enumerate(path):
            assert tokens[s] == tuple(key[: i + 1]), "a cached slot holds another prefix's KV"
        for i in range(max(length - (W - 1), 0), length):
            w = self.alloc.window_of[path[i]]
            assert w and windows[w] == tuple(key[: i + 1]), "a window before the end is not that prefix's"

    def compute(self, key: list[int], length: int, slots: list[int]) -> None:
        tokens, windows = self.kv["device"]
        for i, s in enumerate(slots):
            tokens[s] = windows[self.alloc.window_of[s]] = tuple(key[: length + i + 1])

    @invariant()
    def host_accounted(self) -> None:
        held = 0
        stack = list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.host_value is not None:
                has = [bool(self.host.window_of[s]) for s in node.host_value]
                assert all(has) or not any(has), "a node holds some of its host windows"
                held += sum(has)
        assert held + self.host.windows.available_size() == self.HOST_WINDOWS
        assert self.cache.host_size() + self.host.available_size() == self.HOST_TOKENS


WindowTierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_window_tier_machine = WindowTierMachine.TestCase


class WindowDiskMachine(WindowTierMachine):
    """WindowTierMachine with a disk tier under the host tier, written through: the simulated disk
    holds, per disk slot, a token's KV and (in entries with windows) its window KV; admission reads
    the disk-only end of a match back as CacheManager.admit does, through a mover that runs the
    recorded moves at once."""

    HOST_TOKENS, HOST_WINDOWS = 10, 6
    DISK_SLOTS = 64

    def new_cache(self) -> RadixCache:
        super().new_cache()
        return RadixCache(
            self.alloc,
            self.host,
            disk_allocator=TokenAllocator(self.DISK_SLOTS),
            disk_write_through=True,
            disk_entry_cost=lambda n, _path, windows: n + (n if windows else 0),
            window=W,
        )

    def match(self, key: list[int]) -> tuple[int, TreeNode]:
        cache = self.cache
        length, node = cache.window_match(*cache.match_node(key), host=True)
        if cache.disk_suffix(node)[0]:
            cache.fetch(node, self.move)
            length, node = cache.match_node(key[:length])
            disk_len, memory_node = cache.disk_suffix(node)
            if disk_len:
                length, node = length - disk_len, memory_node
        host_len, device_node = cache.host_suffix(node)
        if host_len and not cache.load(node):
            length, node = length - host_len, device_node
        cache.load_windows(node)
        return cache.window_match(length, node)


WindowDiskMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_window_disk_machine = WindowDiskMachine.TestCase


def test_windows_ending_finished_sequences_go_last() -> None:
    """A long sequence's own windows go before those at the end of a finished one, however recent:
    a follow-up turn matches up to the end, never into the middle."""
    cache, alloc = _windowed_cache()
    _insert(cache, alloc, [1] * 6)
    cache.mark_tail(cache.match_node([1] * 6)[1])
    _insert(cache, alloc, [2] * 10)  # more recent, but no sequence ends in it yet
    # The first two of [1] * 6 (before its end's W), then all of [2] * 10.
    assert cache.evict_windows(5) == 12
    assert cache.window_match(*cache.match_node([1] * 6))[0] == 6
    assert cache.window_match(*cache.match_node([1] * 5))[0] == 5  # the same prompt sent again
    assert cache.window_match(*cache.match_node([2] * 10))[0] == 0
    assert cache.evict_windows(5) == W  # then the tail: the W tokens before its end
