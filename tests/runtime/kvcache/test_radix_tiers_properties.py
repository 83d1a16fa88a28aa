"""Stateful property test of the radix cache with host and disk tiers, driven the way CacheManager
drives it.

Beside the tree, the test keeps the KV itself: a device memory and a host memory of "contents", one
per slot, where a computed token's content names its whole prefix, and a model of the executor's
disk store: entries (files) of contents with the path tokens written beside them, disk slots mapped
to (entry, row), an entry deleted once none of its slots is held. Copies the tree records are run in
order before each step's "forward" (which writes the new tokens' contents), as the executor runs
them; a read from a corrupted entry writes garbage and is reported failed. A restart rebuilds a
fresh tree from the surviving entries, renumbered, as the executor's scan does. A file's bytes are
its rows' and a header's (fixed bytes and some per token of its path, or none), the tree charging
each file its bytes in whole tokens' worth.

After every step: each cached token's content, in whichever tiers hold it, is the one written for
its prefix (a loaded prefix is bit-identical to what was stored, nothing stale or corrupt is
served); every slot of each tier is in exactly one place (free or one node: nothing leaked, nothing
held twice; a disk slot let go by its node stays charged until its file is deleted); the bytes of
the files on disk are within the disk tier's cap, files partly let go included; the tiers nest; the
counters count what the tree holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm_runtime.kvcache import RadixCache, TokenAllocator, TreeNode
from radixlm_runtime.step import DiskEntry, KVCopy

Prefix = tuple[int, ...]
GARBAGE: Prefix = (-1,)
TOKEN_BYTES = 4  # a token's KV in every tier; the disk tier's cap is its slots' worth of bytes

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


@dataclass
class _File:
    tokens: list[int]
    contents: list[Prefix]
    live: int
    corrupt: bool = False

    def size(self, header: tuple[int, int]) -> int:
        """The file's bytes: its rows, and its header (fixed, and per token of its path)."""
        return len(self.contents) * TOKEN_BYTES + header[0] + header[1] * len(self.tokens)

    def cost(self, header: tuple[int, int]) -> int:
        """Its bytes in whole tokens' worth: the disk slots the tree charges for it."""
        return -(-self.size(header) // TOKEN_BYTES)


class TieredCacheMachine(RuleBasedStateMachine):
    @initialize(
        size=st.sampled_from([12, 24]),
        host=st.sampled_from([4, 8, 16, 48]),
        disk=st.sampled_from([0, 8, 32]),
        write_through=st.booleans(),
        disk_write_through=st.booleans(),
        header=st.sampled_from([(0, 0), (3, 1), (6, 2)]),
    )
    def setup(
        self,
        size: int,
        host: int,
        disk: int,
        write_through: bool,
        disk_write_through: bool,
        header: tuple[int, int],
    ) -> None:
        self.sizes = (size, host, disk)
        self.policies = (write_through, disk_write_through)
        self.header = header
        self.files: dict[int, _File] = {}
        self.next_file = 0
        self._fresh_cache([], {})

    def _fresh_cache(self, entries: list[DiskEntry], where: dict[int, tuple[int, int]]) -> None:
        """A new tree (a new process) over the disk entries found at start, `where` their rows are."""
        size, host, disk = self.sizes
        self.alloc = TokenAllocator(size)
        self.host_alloc = TokenAllocator(host)
        self.disk_alloc = TokenAllocator(disk) if disk else None
        fixed, per_path_token = self.header
        self.cache = RadixCache(
            self.alloc,
            self.host_alloc,
            self.policies[0],
            self.disk_alloc,
            self.policies[1],
            lambda n, path, _windows: n + -(-(fixed + per_path_token * path) // TOKEN_BYTES),
        )
        self.device: list[Prefix | None] = [None] * (size + 1)
        self.host: list[Prefix | None] = [None] * (host + 1)
        self.where = where  # disk slot -> (file, row)
        # Tokens loaded onto the device: those of the final loads at admission, and all copied from
        # the host tier onto the device (fetch loads a prefix larger than the host tier in parts).
        self.loaded = 0
        self.copied_to_device = 0
        if self.disk_alloc is not None:
            self.cache.restore(entries)
            self._run_ops(self.cache.take_copies())

    # -- the executor's side ------------------------------------------------------------------
    def _run_ops(self, ops: list[KVCopy]) -> list[int]:
        failed: list[int] = []
        for op in ops:
            if op.dst_tier is None:  # disk slots let go
                for s in op.src:
                    fid, _ = self.where.pop(s)
                    self.files[fid].live -= 1
                    if self.files[fid].live == 0:
                        del self.files[fid]
                continue
            assert len(op.dst) == len(set(op.dst)), "a batch writes a slot twice"
            values = [self._read(op.src_tier, s, failed) for s in op.src]
            if op.dst_tier == "disk":
                assert op.tokens is not None, "a disk entry without its path's tokens"
                start = len(op.tokens) - len(op.dst)
                # The tokens written beside the KV name the prefix each row was computed for.
                assert values == [tuple(op.tokens[: start + i + 1]) for i in range(len(op.dst))]
                fid, self.next_file = self.next_file, self.next_file + 1
                self.files[fid] = _File(list(op.tokens), list(values), len(op.dst))
                for row, s in enumerate(op.dst):
                    assert s not in self.where, "a disk slot written while held"
                    self.where[s] = (fid, row)
                continue
            if op.src_tier == "host" and op.dst_tier == "device":
                self.copied_to_device += len(op.dst)
            dst_mem = self.device if op.dst_tier == "device" else self.host
            for d, v in zip(op.dst, values, strict=True):
                dst_mem[d] = v
        return failed

    def _read(self, tier: str, slot: int, failed: list[int]) -> Prefix | None:
        if tier == "device":
            return self.device[slot]
        if tier == "host":
            return self.host[slot]
        fid, row = self.where[slot]
        if self.files[fid].corrupt:
            failed.append(slot)
            return GARBAGE
        return self.files[fid].contents[row]

    # -- rules ----------------------------------------------------------------------------------
    @rule(key=keys)
    def run_request(self, key: list[int]) -> None:
        """Admission (match, read the disk part into the host tier, load the host part or fall back
        to what is on the device, lock), the step's copies, a forward writing the new tokens,
        insertion and release, as one request does."""
        length, node = self.cache.match_node(key)
        if self.cache.disk_suffix(node)[0]:
            self.cache.fetch(node, self._run_ops)
            length, node = self.cache.match_node(key[:length])
            disk_len, memory_node = self.cache.disk_suffix(node)
            if disk_len:
                length, node = length - disk_len, memory_node
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
        self._run_ops(self.cache.take_copies())
        # The loaded and matched prefix reads exactly what was written for it: never garbage.
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
        self._run_ops(self.cache.take_copies())

    @rule(key=keys)
    def match(self, key: list[int]) -> None:
        length, node = self.cache.match_node(key)
        host_len, device_node = self.cache.host_suffix(node)
        disk_len, _ = self.cache.disk_suffix(node)
        assert 0 <= disk_len <= host_len <= length
        assert len(self.cache.disk_path_slots(node)) == disk_len  # what a read ahead would read
        slots = self.cache.path_slots(device_node)
        assert len(slots) == length - host_len

    @rule(n=st.integers(min_value=1, max_value=16))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_size()
        available = self.alloc.available_size()
        freed = self.cache.evict(n)
        assert freed >= min(n, evictable)
        assert self.alloc.available_size() == available + freed
        self._run_ops(self.cache.take_copies())

    @precondition(lambda self: self.files)
    @rule(pick=st.integers(min_value=0))
    def corrupt_file(self, pick: int) -> None:
        fids = sorted(self.files)
        self.files[fids[pick % len(fids)]].corrupt = True

    @precondition(lambda self: self.disk_alloc is not None)
    @rule(graceful=st.booleans())
    def restart(self, graceful: bool) -> None:
        """A new process on the same directory: every file survives whole (rows whose slots were
        let go included), the newest first as far as the disk tier holds them, renumbered. A
        graceful shutdown first writes what is only in memory; a crash loses it (and the moves not
        yet run)."""
        if graceful:
            self.cache.persist()
            self._run_ops(self.cache.take_copies())
        capacity, kept, total = self.sizes[2], {}, 0
        for fid in sorted(self.files, reverse=True):
            if total + self.files[fid].cost(self.header) <= capacity:
                kept[fid] = self.files[fid]
                total += self.files[fid].cost(self.header)
        entries: list[DiskEntry] = []
        self.files = {}
        slot = 1
        where: dict[int, tuple[int, int]] = {}
        for fid, f in sorted(kept.items()):
            n = len(f.contents)
            entries.append(DiskEntry(tuple(f.tokens), tuple(range(slot, slot + n))))
            where.update({slot + row: (fid, row) for row in range(n)})
            self.files[fid] = _File(f.tokens, f.contents, n, f.corrupt)
            slot += n
        self._fresh_cache(entries, where)

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self._run_ops(self.cache.take_copies())
        assert self.alloc.available_size() == self.alloc.size
        assert self.host_alloc.available_size() == self.host_alloc.size
        assert self.cache.host_size() == 0 and self.cache.disk_size() == 0 and self.cache.num_nodes() == 1
        assert not self.files and not self.where

    # -- invariants -----------------------------------------------------------------------------
    @precondition(lambda self: self.loaded)
    @invariant()
    def loads_are_counted(self) -> None:
        """Every token copied from the host tier to the device is counted once, admission's final
        loads and the loads between a large fetch's parts alike."""
        assert self.cache.loaded_tokens == self.copied_to_device >= self.loaded

    @invariant()
    def every_copy_holds_its_prefix(self) -> None:
        for node, path in _nodes(self.cache):
            start = len(path) - len(node.key)
            want = [path[: start + i + 1] for i in range(len(node.key))]
            assert node.tier, "a node in no tier"
            if node.value is not None:
                assert [self.device[s] for s in node.value] == want
            if node.host_value is not None:
                assert [self.host[s] for s in node.host_value] == want
            if node.disk_value is not None:
                rows = [self.where[s] for s in node.disk_value]
                assert [self.files[fid].contents[row] for fid, row in rows] == want

    @invariant()
    def tiers_nest(self) -> None:
        """The device tier is prefix-closed, and so are the device and host tiers together."""
        for node, _ in _nodes(self.cache):
            assert node.parent is not None
            if node.on_device:
                assert node.parent.on_device
            if node.in_memory and node.parent is not self.cache.root_node:
                assert node.parent.in_memory

    @invariant()
    def slots_are_partitioned(self) -> None:
        nodes = [n for n, _ in _nodes(self.cache)]
        tiers = [
            (self.alloc, [s for n in nodes for s in n.value or ()]),
            (self.host_alloc, [s for n in nodes for s in n.host_value or ()]),
        ]
        if self.disk_alloc is not None:
            disk_slots = [s for n in nodes for s in n.disk_value or ()]
            assert set(self.where) == set(disk_slots), "the executor holds other disk slots than the tree"
            # Every file costs its slots until it is deleted, whatever of it nodes still hold.
            charged = sum(f.cost(self.header) for f in self.files.values())
            assert self.disk_alloc.available_size() == self.disk_alloc.size - charged, "a disk slot leaked"
            tiers.append((self.disk_alloc, disk_slots))
        for alloc, tree_slots in tiers:
            free = alloc.alloc(alloc.available_size())
            assert free is not None
            alloc.free(free)
            everything = free + tree_slots
            assert len(everything) == len(set(everything)), "a slot is in two places"
            assert set(everything) <= set(range(1, alloc.size + 1))
            if alloc is not self.disk_alloc:
                assert set(everything) == set(range(1, alloc.size + 1)), "a slot leaked"

    @invariant()
    def files_fit_the_disk_cap(self) -> None:
        """The files on disk (the writer thread's queue flushed: the model deletes a file at once)
        take no more bytes than the disk tier's cap, partly let go ones at their whole size."""
        cap = self.sizes[2] * TOKEN_BYTES
        assert sum(f.size(self.header) for f in self.files.values()) <= cap

    @invariant()
    def counters_count_the_tiers(self) -> None:
        nodes = [n for n, _ in _nodes(self.cache)]
        assert self.cache.total_size() == sum(len(n.key) for n in nodes if n.on_device)
        assert self.cache.protected_size() == 0  # nothing holds a lock between steps
        assert self.cache.host_size() == sum(len(n.host_value or ()) for n in nodes)
        assert self.cache.disk_size() == sum(len(n.disk_value or ()) for n in nodes)
        assert self.cache.num_nodes() == len(nodes) + 1
        assert all(self.cache.node(n.id) is n for n in nodes)


TieredCacheMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieredCacheMachine = TieredCacheMachine.TestCase
