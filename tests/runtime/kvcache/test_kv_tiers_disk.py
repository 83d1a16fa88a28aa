"""The radix tree's disk tier with the executor's side of it (executor/kv_tiers.py, a real DiskStore on
CPU pools): the files the tree's moves leave on disk stay within --kv-disk-bytes, headers and entries
partly let go included."""

from __future__ import annotations

from pathlib import Path

import torch

from radixlm_runtime.executor.kv_tiers import KVTiers
from radixlm_runtime.kvcache import RadixCache, TokenAllocator
from radixlm_runtime.kvcache.disk_tier import DiskStore, layout_of
from radixlm_runtime.kvcache.pool import KVPool

# 2 layers x K and V x 2 heads x 64 float32: 2 KiB a token, so a header is under one token's worth.
DIMS = (2, 2, 64)


def _tiers(tmp_path: Path, device: int, host: int, disk_bytes: int) -> tuple[RadixCache, KVTiers]:
    pool = KVPool(device, *DIMS, torch.float32, "cpu")
    host_pool = KVPool(host, *DIMS, torch.float32, "cpu")
    capacity = disk_bytes // pool.bytes_per_token()
    store = DiskStore(tmp_path, "a" * 40, layout_of(pool.named_tensors()), capacity)
    tiers = KVTiers(pool, host_pool, store)
    tree = RadixCache(
        TokenAllocator(device),
        TokenAllocator(host),
        disk_allocator=TokenAllocator(store.capacity_tokens),
        disk_write_through=True,
        disk_entry_cost=store.entry_slots,
    )
    return tree, tiers


def _compute(tree: RadixCache, tiers: KVTiers, key: list[int]) -> None:
    """A request computing key past its prefix on the device: fresh device slots (least recently
    used ones evicted for room), inserted (and written through to disk), the recorded moves run."""
    prefix, node = tree.match_prefix(key)
    tree.inc_lock_ref(node)
    short = len(key) - len(prefix) - tree.allocator.available_size()
    if short > 0:
        tree.evict(short)
    fresh = tree.allocator.alloc(len(key) - len(prefix))
    assert fresh is not None
    tree.insert(key, prefix + fresh)
    tree.dec_lock_ref(node)
    assert not tiers.run(tree.take_copies())


def _bytes_on_disk(store: DiskStore) -> int:
    store.flush()
    return sum(p.stat().st_size for p in store.dir.glob("*.kv"))


def test_a_partly_evicted_entry_keeps_costing_its_whole_file(tmp_path: Path) -> None:
    """A 6-token entry is split and its lower half evicted: its file stays whole on disk while the
    upper half is held, so an 8-token entry that needs room evicts the upper half too, and the files
    never take more than the cap (counted per token, the lower half's 3 slots would have been handed
    to the new entry while the old file still held them: 14 tokens of KV on a 12-token disk)."""
    cap = 12 * 2048
    tree, tiers = _tiers(tmp_path, device=16, host=8, disk_bytes=cap)
    store = tiers.disk
    assert store is not None and store.entry_slots(6, 6) == 7  # its rows and a header
    a = [1, 2, 3, 4, 5, 6]
    _compute(tree, tiers, a)
    tree.match_node(a[:3])  # splits the entry's node: the upper half touched, the lower half not
    _compute(tree, tiers, [9, 8, 7, 6, 5, 4, 3, 2])
    assert _bytes_on_disk(store) <= cap
    assert len(list(store.dir.glob("*.kv"))) == 1  # only the new entry: the old file went whole
    assert tree.disk_allocator is not None and tree.disk_allocator.available_size() == 12 - 9
    tiers.close()


def test_headers_count_against_the_cap(tmp_path: Path) -> None:
    """Entries of one token under a long path: each file's header (the path's token ids) takes more
    than the token's KV, and counts against the cap too; a restart keeps what fits of them."""
    cap = 8 * 2048
    tree, tiers = _tiers(tmp_path, device=4300, host=8, disk_bytes=cap)
    store = tiers.disk
    assert store is not None and store.entry_slots(1, 602) == 3
    for i in range(1, 8):
        key = [i] * 600 + [7]  # too long for the disk tier itself: only its one-token child is written
        _compute(tree, tiers, key)
        _compute(tree, tiers, [*key, 8])
        assert _bytes_on_disk(store) <= cap
    tiers.close()
    again = DiskStore(tmp_path, "a" * 40, store.layout, store.capacity_tokens)
    found = again.scan()
    assert len(found) == 2 and sum(again.entry_slots(len(e.slots), len(e.tokens)) for e in found) <= 8
    assert _bytes_on_disk(again) <= cap
    again.close()


def _restarted(tmp_path: Path, keys: list[list[int]]) -> tuple[RadixCache, KVTiers]:
    """Tiers whose disk tier holds an entry per key (written, then found again by a new store, as a
    restarted server does), with a fresh tree rebuilt from them; the store reads ahead up to the
    host tier's bytes."""
    tree, tiers = _tiers(tmp_path, device=64, host=32, disk_bytes=64 * 2048)
    for key in keys:
        _compute(tree, tiers, key)
    tiers.close()
    assert tiers.disk is not None and tiers.host is not None
    old = tiers.disk
    store = DiskStore(tmp_path, "a" * 40, old.layout, old.capacity_tokens, 32 * old.token_bytes)
    tiers = KVTiers(tiers.pool, tiers.host, store)
    tree = RadixCache(
        TokenAllocator(64),
        TokenAllocator(32),
        disk_allocator=TokenAllocator(store.capacity_tokens),
        disk_write_through=True,
        disk_entry_cost=store.entry_slots,
    )
    tree.restore(tiers.disk_entries)
    assert not tiers.run(tree.take_copies())
    return tree, tiers


def test_a_prefetched_entry_is_read_once_and_served_from_memory(tmp_path: Path) -> None:
    key = list(range(1, 11))
    tree, tiers = _restarted(tmp_path, [key])
    store = tiers.disk
    assert store is not None
    loads: list[Path] = []
    load = store._load
    store._load = lambda entry: loads.append(entry.path) or load(entry)  # type: ignore[method-assign]
    _, node = tree.match_node(key)
    slots = tree.disk_path_slots(node)
    assert len(slots) == 10
    assert tiers.prefetch(slots) in (0, 10)  # being read, or read already
    assert tiers.prefetch(slots) in (0, 10) and store.files_prefetched == 1  # not read twice
    assert tree.fetch(node, tiers.run) == 10
    assert len(loads) == 1 and store.files_read == 0 and store.prefetch_hits == 1
    assert store.prefetched_bytes() == 0  # used whole: its memory let go
    # What was read ahead is what was written: the host slots hold the rows of the device's.
    assert tree.load(node) == 10
    assert node.value is not None
    tiers.close()


def test_a_corrupt_prefetched_entry_is_recomputed_not_served(tmp_path: Path) -> None:
    key = list(range(1, 11))
    tree, tiers = _restarted(tmp_path, [key, [*key, 11, 12]])
    store = tiers.disk
    assert store is not None
    first = max(store.dir.glob("*.kv"), key=lambda p: p.stat().st_size)  # the 10-token entry
    data = bytearray(first.read_bytes())
    data[-3] ^= 0x10
    first.write_bytes(data)
    length, node = tree.match_node([*key, 11, 12])
    assert length == 12
    assert tiers.prefetch(tree.disk_path_slots(node)) in (0, 12)
    assert tree.fetch(node, tiers.run) == 0  # the first entry failed: nothing of the path served
    assert tree.disk_failed_tokens == 10 and store.corrupt_entries == 1 and store.files_read == 0
    assert tree.match_node([*key, 11, 12])[0] == 0  # recomputed from scratch
    assert not first.exists()
    # The second entry's tokens left the tree with the first: its file goes, its read ahead too.
    assert not tiers.run(tree.take_copies())
    store.flush()
    assert not list(store.dir.glob("*.kv")) and store.prefetched_bytes() == 0
    tiers.close()


def test_reads_ahead_stay_within_their_budget_and_keep_their_room(tmp_path: Path) -> None:
    """5 entries of 12 tokens, 32 tokens' worth read ahead: two are, the others are refused (read
    when admitted) rather than taking the room of reads still asked for, which are never read twice."""
    keys = [[k] * 12 for k in range(1, 6)]
    tree, tiers = _restarted(tmp_path, keys)
    store = tiers.disk
    assert store is not None
    for _ in range(3):  # a scheduler asks every step for every waiting request
        for key in keys:
            _, node = tree.match_node(key)
            tiers.prefetch(tree.disk_path_slots(node))
            assert store.prefetched_bytes() <= 32 * store.token_bytes
    assert store.files_prefetched == 2
    tiers.close()
