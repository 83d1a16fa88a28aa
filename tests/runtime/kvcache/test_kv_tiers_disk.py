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
