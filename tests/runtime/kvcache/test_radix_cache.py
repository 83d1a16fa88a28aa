"""RadixCache behaviour on hand-built scenarios: matching, splitting, locking and LRU eviction."""

from __future__ import annotations

import pytest

from radixlm_runtime.kvcache import RadixCache, TokenAllocator, TreeNode


def _make(size: int = 64) -> tuple[TokenAllocator, RadixCache]:
    alloc = TokenAllocator(size)
    return alloc, RadixCache(alloc)


def _insert_new(alloc: TokenAllocator, cache: RadixCache, key: list[int]) -> list[int]:
    """Caches key the way a finished request does: fresh slots for its uncached suffix."""
    prefix, _ = cache.match_prefix(key)
    new = alloc.alloc(len(key) - len(prefix))
    assert new is not None
    value = prefix + new
    assert cache.insert(key, value) == len(prefix)
    return value


def _check_accounting(alloc: TokenAllocator, cache: RadixCache, outside: int = 0) -> None:
    assert cache.evictable_size() + cache.protected_size() == cache.total_size()
    assert alloc.available_size() + cache.total_size() + outside == alloc.size


def _nodes(cache: RadixCache) -> list[TreeNode]:
    out: list[TreeNode] = []
    stack = list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def test_empty_cache_matches_nothing() -> None:
    alloc, cache = _make()
    value, node = cache.match_prefix([1, 2, 3])
    assert value == []
    assert node is cache.root_node
    assert cache.total_size() == 0
    assert cache.root_node.lock_ref == 1


def test_empty_key_insert_and_match() -> None:
    alloc, cache = _make()
    assert cache.insert([], []) == 0
    value, node = cache.match_prefix([])
    assert value == [] and node is cache.root_node
    _insert_new(alloc, cache, [1, 2])
    value, node = cache.match_prefix([])
    assert value == [] and node is cache.root_node
    assert cache.insert([], []) == 0
    _check_accounting(alloc, cache)


def test_insert_then_match_returns_the_inserted_slots() -> None:
    alloc, cache = _make()
    value = _insert_new(alloc, cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 3, 4])
    assert got == value
    assert node.key == [1, 2, 3, 4]
    # A longer query matches the cached part only.
    got, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert got == value
    assert node.key == [1, 2, 3, 4]
    # A query diverging at the first token matches nothing.
    got, node = cache.match_prefix([2, 2])
    assert got == [] and node is cache.root_node
    assert cache.total_size() == 4 and cache.evictable_size() == 4
    _check_accounting(alloc, cache)


def test_insert_returns_already_present_prefix_length() -> None:
    alloc, cache = _make()
    first = _insert_new(alloc, cache, [1, 2, 3])
    assert cache.insert([1, 2, 3], first) == 3
    # Same prefix with fresh duplicate slots: the tree keeps its own, the caller frees the duplicates.
    dup = alloc.alloc(5)
    assert dup is not None
    assert cache.insert([1, 2, 3, 7, 8], dup) == 3
    alloc.free(dup[:3])
    got, _ = cache.match_prefix([1, 2, 3, 7, 8])
    assert got == first + dup[3:]
    assert cache.total_size() == 5
    _check_accounting(alloc, cache)


def test_insert_of_a_prefix_of_a_cached_key_splits_and_reports_full_match() -> None:
    alloc, cache = _make()
    value = _insert_new(alloc, cache, [1, 2, 3, 4])
    assert cache.insert([1, 2], value[:2]) == 2
    assert [n.key for n in _nodes(cache)] in ([[1, 2], [3, 4]], [[3, 4], [1, 2]])
    assert cache.total_size() == 4
    _check_accounting(alloc, cache)


def test_match_inside_an_edge_splits_the_node() -> None:
    alloc, cache = _make()
    value = _insert_new(alloc, cache, [1, 2, 3, 4, 5])
    got, node = cache.match_prefix([1, 2, 3, 9])
    assert got == value[:3]
    assert node.key == [1, 2, 3]
    assert node.value == value[:3]
    assert node.parent is cache.root_node
    (child,) = node.children.values()
    assert child.key == [4, 5] and child.value == value[3:]
    assert child.parent is node
    # The full key still matches across the split.
    got, deepest = cache.match_prefix([1, 2, 3, 4, 5])
    assert got == value and deepest is child
    assert cache.total_size() == 5
    _check_accounting(alloc, cache)


def test_match_with_query_ending_inside_an_edge_splits_there() -> None:
    alloc, cache = _make()
    value = _insert_new(alloc, cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2])
    assert got == value[:2]
    assert node.key == [1, 2]


def test_match_node_reports_length_and_node_like_match_prefix() -> None:
    alloc, cache = _make()
    value = _insert_new(alloc, cache, [1, 2, 3, 4])
    _insert_new(alloc, cache, [1, 2, 3, 4, 5, 6])
    # Full match, longer query, diverging query and a miss.
    for key, want in (([1, 2, 3, 4], 4), ([1, 2, 3, 4, 5, 6, 7], 6), ([1, 2, 3, 4, 9], 4), ([7], 0)):
        length, node = cache.match_node(key)
        slots, same = cache.match_prefix(key)
        assert length == want == len(slots)
        assert same is node
        assert cache.path_slots(node) == slots
    assert cache.match_node([1, 2, 3, 4])[1].value == value
    assert cache.match_node([])[0] == 0 and cache.match_node([])[1] is cache.root_node
    _check_accounting(alloc, cache)


def test_match_node_on_empty_cache() -> None:
    _, cache = _make()
    length, node = cache.match_node([1, 2, 3])
    assert length == 0 and node is cache.root_node
    assert cache.path_slots(node) == []


def test_match_node_inside_an_edge_splits_so_the_node_can_be_locked() -> None:
    """match_node splits the way match_prefix does: locking its node pins exactly the matched tokens."""
    alloc, cache = _make()
    value = _insert_new(alloc, cache, [1, 2, 3, 4, 5])
    length, node = cache.match_node([1, 2, 3, 9])
    assert length == 3
    assert node.key == [1, 2, 3] and node.value == value[:3]
    assert node.parent is cache.root_node
    (child,) = node.children.values()
    assert child.key == [4, 5] and child.value == value[3:]
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3, 4, 5])[0] == value[:3]
    cache.dec_lock_ref(node)
    _check_accounting(alloc, cache)


def test_path_slots_concatenates_slots_from_root_to_node() -> None:
    alloc, cache = _make()
    a = _insert_new(alloc, cache, [1, 2, 3, 4])
    b = _insert_new(alloc, cache, [1, 2, 7, 8, 9])
    _, upper = cache.match_node([1, 2])
    _, leaf_a = cache.match_node([1, 2, 3, 4])
    _, leaf_b = cache.match_node([1, 2, 7, 8, 9])
    assert leaf_a.parent is upper and leaf_b.parent is upper
    assert cache.path_slots(upper) == a[:2]
    assert cache.path_slots(leaf_a) == a
    assert cache.path_slots(leaf_b) == a[:2] + b[2:]
    assert cache.path_slots(cache.root_node) == []


def test_match_node_refreshes_lru_order() -> None:
    """The scheduler re-matches waiting requests with match_node: that counts as an access."""
    alloc, cache = _make()
    a = _insert_new(alloc, cache, [1, 1])
    _insert_new(alloc, cache, [2, 2])
    cache.match_node([1, 1])
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 1])[0] == a
    assert cache.match_prefix([2, 2])[0] == []
    _check_accounting(alloc, cache)


def test_insert_diverging_mid_edge_creates_branch() -> None:
    alloc, cache = _make()
    a = _insert_new(alloc, cache, [1, 2, 3, 4])
    b = alloc.alloc(4)
    assert b is not None
    assert cache.insert([1, 2, 7, 8], b) == 2
    alloc.free(b[:2])
    got_a, node_a = cache.match_prefix([1, 2, 3, 4])
    got_b, node_b = cache.match_prefix([1, 2, 7, 8])
    assert got_a == a
    assert got_b == a[:2] + b[2:]
    assert node_a.parent is node_b.parent
    assert node_a.parent is not None and node_a.parent.key == [1, 2]
    assert cache.total_size() == 6
    _check_accounting(alloc, cache)


def test_insert_after_match_on_split_path() -> None:
    alloc, cache = _make()
    a = _insert_new(alloc, cache, [5, 6, 7, 8])
    prefix, node = cache.match_prefix([5, 6, 9])
    assert prefix == a[:2]
    cache.inc_lock_ref(node)
    new = alloc.alloc(2)
    assert new is not None
    value = prefix + new
    assert cache.insert([5, 6, 9, 10], value) == 2
    cache.dec_lock_ref(node)
    got, _ = cache.match_prefix([5, 6, 9, 10])
    assert got == value
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    _check_accounting(alloc, cache)


def test_insert_rejects_mismatched_value_length() -> None:
    _, cache = _make()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [1, 2])


def test_insert_copies_value() -> None:
    """Callers pass their request's token and slot lists, which they keep appending to (decode
    tokens) or overwrite after the insert."""
    alloc, cache = _make()
    slots = alloc.alloc(3)
    assert slots is not None
    key, row = [1, 2, 3], list(slots)
    cache.insert(key, row)
    row[:] = [0, 0, 0]
    row.append(7)
    key[:] = [9, 9, 9]
    got, node = cache.match_prefix([1, 2, 3])
    assert got == slots and node.key == [1, 2, 3]


def test_match_prefix_returns_a_list_the_caller_owns() -> None:
    """A request extends its matched prefix with fresh slots in place; the tree must not see it."""
    alloc, cache = _make()
    value = _insert_new(alloc, cache, [1, 2, 3])
    got, _ = cache.match_prefix([1, 2, 3])
    got.append(50)
    got[0] = 0
    assert cache.match_prefix([1, 2, 3])[0] == value
    assert cache.path_slots(cache.match_node([1, 2, 3])[1]) == value


def test_lock_moves_tokens_between_counters_along_the_path() -> None:
    alloc, cache = _make()
    _insert_new(alloc, cache, [1, 2, 3, 4])
    _insert_new(alloc, cache, [1, 2, 5])
    _, node = cache.match_prefix([1, 2, 5])
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3  # [1, 2] and [5]
    assert cache.evictable_size() == 2  # [3, 4]
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 3
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    _check_accounting(alloc, cache)


def test_split_of_locked_node_keeps_lock_ref_and_counters() -> None:
    alloc, cache = _make()
    _insert_new(alloc, cache, [1, 2, 3, 4])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    _, upper = cache.match_prefix([1, 2, 9])
    assert upper.key == [1, 2]
    assert upper.lock_ref == 1 and node.lock_ref == 1
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.dec_lock_ref(node)
    assert upper.lock_ref == 0
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    _check_accounting(alloc, cache)


def test_evict_frees_least_recently_used_leaf_first() -> None:
    alloc, cache = _make()
    old = _insert_new(alloc, cache, [1, 1, 1])
    new = _insert_new(alloc, cache, [2, 2, 2])
    assert cache.evict(1) == 3
    assert cache.match_prefix([1, 1, 1])[0] == []
    assert cache.match_prefix([2, 2, 2])[0] == new
    assert alloc.available_size() == 64 - 3
    # The freed slots are exactly the evicted node's: they can be allocated again.
    rest = alloc.alloc(alloc.available_size())
    assert rest is not None and set(old) <= set(rest)


def test_access_refreshes_lru_order() -> None:
    alloc, cache = _make()
    a = _insert_new(alloc, cache, [1, 1])
    _insert_new(alloc, cache, [2, 2])
    _insert_new(alloc, cache, [3, 3])
    cache.match_prefix([1, 1])  # [1, 1] is now the most recently used
    assert cache.evict(3) == 4
    assert cache.match_prefix([1, 1])[0] == a
    assert cache.match_prefix([2, 2])[0] == []
    assert cache.match_prefix([3, 3])[0] == []
    _check_accounting(alloc, cache)


def test_evict_climbs_to_parent_once_its_last_child_goes() -> None:
    alloc, cache = _make()
    _insert_new(alloc, cache, [1, 2, 3])
    _insert_new(alloc, cache, [1, 2, 4])
    newest = _insert_new(alloc, cache, [9, 9])  # newest, so evicted last
    assert cache.evict(4) == 4
    # [3], [4] and then their parent [1, 2] went before the newer [9, 9].
    assert cache.match_prefix([1])[0] == []
    assert cache.match_prefix([9, 9])[0] == newest
    assert cache.total_size() == 2
    _check_accounting(alloc, cache)


def test_locked_paths_are_never_evicted() -> None:
    alloc, cache = _make()
    locked = _insert_new(alloc, cache, [1, 2, 3, 4])
    _insert_new(alloc, cache, [1, 2, 5, 6])
    _insert_new(alloc, cache, [7, 8])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    # Ask for everything: only the unlocked branch [5, 6] and [7, 8] can go.
    assert cache.evict(100) == 4
    assert cache.match_prefix([1, 2, 3, 4])[0] == locked
    assert cache.match_prefix([7])[0] == []
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    assert cache.evict(1) == 0
    cache.dec_lock_ref(node)
    # Once unlocked, the leaf [3, 4] goes first and then its now childless parent [1, 2].
    assert cache.evict(1) == 2
    assert cache.evict(1) == 2
    assert cache.total_size() == 0
    assert alloc.available_size() == 64


def test_locked_inner_node_protects_only_its_path() -> None:
    alloc, cache = _make()
    value = _insert_new(alloc, cache, [1, 2, 3, 4])
    _, inner = cache.match_prefix([1, 2])
    cache.inc_lock_ref(inner)
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3])[0] == value[:2]
    assert cache.total_size() == 2 and cache.protected_size() == 2
    cache.dec_lock_ref(inner)
    _check_accounting(alloc, cache)


def test_evict_nonpositive_is_noop() -> None:
    alloc, cache = _make()
    _insert_new(alloc, cache, [1, 2])
    assert cache.evict(0) == 0
    assert cache.total_size() == 2


def test_evict_frees_slots_to_allocator_with_exact_accounting() -> None:
    alloc, cache = _make(16)
    for key in ([0, 1, 2, 3], [0, 1, 5], [2, 2, 2, 2, 2], [3]):
        _insert_new(alloc, cache, key)
    assert cache.total_size() == 11
    assert alloc.available_size() == 5
    freed = cache.evict(6)
    assert freed >= 6
    assert alloc.available_size() == 5 + freed
    _check_accounting(alloc, cache)


def test_reset_frees_everything() -> None:
    alloc, cache = _make(16)
    _insert_new(alloc, cache, [1, 2, 3])
    _insert_new(alloc, cache, [1, 4])
    cache.reset()
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    assert alloc.available_size() == 16
    assert cache.match_prefix([1, 2, 3])[0] == []
    # The cache is usable again after a reset.
    _insert_new(alloc, cache, [1, 2, 3])
    assert cache.total_size() == 3
    _check_accounting(alloc, cache)


def test_reset_refuses_while_locked() -> None:
    alloc, cache = _make(16)
    _insert_new(alloc, cache, [1, 2, 3])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    assert cache.total_size() == 3
    cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.available_size() == 16


def test_pretty_print_lists_every_node() -> None:
    alloc, cache = _make()
    a = _insert_new(alloc, cache, [1, 2, 3])
    b = _insert_new(alloc, cache, [1, 2, 4])
    text = cache.pretty_print()
    assert "total=4" in text
    for key, value in (([1, 2], a[:2]), ([3], a[2:]), ([4], b[2:])):
        assert f"key={key} value={value} " in text


# -- token logprobs kept beside the KV --------------------------------------------------------
NAN = float("nan")


def _known(values: list[float]) -> list[float | None]:
    """NaN (unknown) as None, so lists compare with ==."""
    return [None if v != v else v for v in values]


def test_insert_stores_logprobs_and_path_returns_them() -> None:
    alloc, cache = _make()
    slots = alloc.alloc(5)
    assert slots is not None
    top = [None, [(-0.1, 7)], None, None, [(-0.5, 9), (-1.0, 2)]]
    cache.insert([1, 2, 3, 4, 5], slots, [NAN, -0.1, NAN, -2.0, -0.5], top)
    _, node = cache.match_prefix([1, 2, 3, 4, 5])
    logprobs, tops = cache.path_logprobs(node)
    assert _known(logprobs) == [None, -0.1, None, -2.0, -0.5] and tops == top
    # A plain insert (no logprobs asked for) knows nothing.
    other = alloc.alloc(2)
    assert other is not None
    cache.insert([8, 9], other)
    logprobs, tops = cache.path_logprobs(cache.match_prefix([8, 9])[1])
    assert _known(logprobs) == [None, None] and tops == [None, None]


def test_split_keeps_each_tokens_logprob_with_it() -> None:
    alloc, cache = _make()
    slots = alloc.alloc(4)
    assert slots is not None
    cache.insert([1, 2, 3, 4], slots, [NAN, -1.0, -2.0, -3.0], [None, None, [(-2.0, 3)], None])
    _, upper = cache.match_prefix([1, 2])  # splits the edge after two tokens
    assert _known(cache.path_logprobs(upper)[0]) == [None, -1.0]
    _, lower = cache.match_prefix([1, 2, 3, 4])
    logprobs, tops = cache.path_logprobs(lower)
    assert _known(logprobs) == [None, -1.0, -2.0, -3.0] and tops[2] == [(-2.0, 3)]
    assert lower.parent is upper and _known(lower.logprobs or []) == [-2.0, -3.0]


def test_later_inserts_fill_in_unknown_logprobs_only() -> None:
    alloc, cache = _make()
    value = _insert_new(alloc, cache, [1, 2, 3, 4])
    cache.insert([1, 2, 3, 4], value, [NAN, NAN, -3.0, NAN], [None, None, [(-3.0, 3)], None])
    cache.insert([1, 2, 3, 4], value, [NAN, -2.0, -99.0, NAN], [None, None, [(-3.0, 3), (-4.0, 1)], None])
    logprobs, tops = cache.path_logprobs(cache.match_prefix([1, 2, 3, 4])[1])
    # Known values are never overwritten; wider top lists replace narrower ones.
    assert _known(logprobs) == [None, -2.0, -3.0, None]
    assert tops[2] == [(-3.0, 3), (-4.0, 1)]
    _check_accounting(alloc, cache)


@pytest.mark.parametrize("leaves", [50, 2000])
def test_eviction_cost_does_not_grow_with_the_tree(leaves: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicting one node from each tier (device -> host -> disk -> dropped) checks a handful of
    heap entries, as many with 2,000 leaves as with 50: no tier walks its leaves."""
    alloc, host, disk = TokenAllocator(leaves), TokenAllocator(leaves // 2), TokenAllocator(leaves // 4)
    cache = RadixCache(alloc, host, disk_allocator=disk)
    for token in range(leaves):
        _insert_new(alloc, cache, [token])
    # Fill the lower tiers: every device eviction now pushes one node down each tier.
    assert cache.evict(leaves // 2 + leaves // 4) == leaves // 2 + leaves // 4
    assert host.available_size() == 0 and disk.available_size() == 0
    checks = 0
    for name in ("_is_device_candidate", "_is_host_candidate", "_is_disk_candidate"):
        check = getattr(RadixCache, name)

        def counted(node: TreeNode, check=check) -> bool:
            nonlocal checks
            checks += 1
            return check(node)

        monkeypatch.setattr(RadixCache, name, staticmethod(counted))
    dropped = cache.disk_evicted_tokens
    assert cache.evict(1) == 1
    assert cache.disk_evicted_tokens == dropped + 1  # one node left the tree from the disk tier
    assert checks <= 16
