"""Glue between requests and the KV memory's bookkeeping: the radix tree, the slot and table-row
free lists (the device pool's, the host tier's and the disk tier's) and the program sessions
pinning KV. Every slot
a request touches is accounted for here, so that when a request finishes, is retracted or is
aborted its slots either join the tree or return to the free list. All of it is host data: the
executor owns the tensors."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from radixlm_runtime.kvcache.allocator import RowAllocator, TokenAllocator, WindowedAllocator
from radixlm_runtime.kvcache.radix_cache import EntryCost, Mover, RadixCache, TreeNode
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.scheduler.session import SessionTable
from radixlm_runtime.step import DiskEntry, KVCopy


class CacheManager:
    """Owns the free lists of KV memory (the executor owns the tensors they index)."""

    def __init__(
        self,
        allocator: TokenAllocator,
        rows: RowAllocator,
        disable_radix_cache: bool,
        session_timeout_s: float = 60.0,
        session_pin_fraction: float = 0.5,
        host_allocator: TokenAllocator | None = None,
        write_through: bool = False,
        disk_allocator: TokenAllocator | None = None,
        disk_write_through: bool = False,
        move: Mover | None = None,
        disk_entries: Sequence[DiskEntry] = (),
        disk_entry_cost: EntryCost | None = None,
        prefetch: Callable[[list[int]], int] | None = None,
        window: int = 0,
    ) -> None:
        """`move` runs tier moves at once (Executor.move_kv): reads from the disk tier go through it.
        `disk_entries`: what the disk tier held at start, which the tree is rebuilt from;
        `disk_entry_cost`: the disk slots an entry file costs (RunnerInfo.disk_entry_slots);
        `prefetch` starts reading disk slots ahead (Executor.prefetch_kv; None: never).
        `window`: a windowed pool's widest sliding window (RunnerInfo.sliding_window), whose window
        slots `allocator`, a WindowedAllocator, hands out; 0: none."""
        if window and not isinstance(allocator, WindowedAllocator):
            raise ValueError("window slots need a WindowedAllocator")
        self.window = window
        self.windows = allocator if isinstance(allocator, WindowedAllocator) else None
        self.allocator = allocator
        self.rows = rows
        self.tree = (
            None
            if disable_radix_cache
            else RadixCache(
                allocator,
                host_allocator,
                write_through,
                disk_allocator,
                disk_write_through,
                disk_entry_cost,
                window,
            )
        )
        if disk_allocator is not None and move is None:
            raise ValueError("a disk tier needs the executor's move_kv to read it")
        self.move = move
        self._prefetch = prefetch if disk_allocator is not None else None
        if self.tree is not None and disk_allocator is not None:
            self.tree.restore(disk_entries)
        # Prompt tokens admitted from the device pool and loaded back from the host and disk tiers;
        # reads of the disk tier (each one move_kv call) and the seconds they took.
        self.device_hit_tokens = self.host_hit_tokens = self.disk_hit_tokens = 0
        self.disk_reads = 0
        self.disk_read_seconds = 0.0
        self.sessions = SessionTable(self.tree, session_timeout_s, int(session_pin_fraction * allocator.size))

    # -- capacity -----------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Slots that can be handed out now: free ones plus unlocked ones the tree can evict (window
        slots: available_windows)."""
        evictable = self.tree.evictable_size() if self.tree is not None else 0
        return self.allocator.available_size() + evictable

    def available_windows(self) -> int:
        """Window slots that can be handed out now: free ones plus those the tree can evict (a
        request needs a window's worth, not one per token: admission.py)."""
        assert self.windows is not None
        evictable = self.tree.window_evictable_size() if self.tree is not None else 0
        return self.windows.windows.available_size() + evictable

    def window_growth(self, req: Req) -> int:
        """Window slots req will still take before its own tokens hold a window's worth (from then
        on each new token's frees an old one's: trim_windows)."""
        if not self.window:
            return 0
        own = req.kv_len - max(req.window_from, req.prefix_len)
        return max(self.window - own, 0)

    def alloc_slots(self, n: int) -> list[int] | None:
        """n token slots (each with a window slot, where there are window slots), making room by
        evicting from the tree what is short."""
        if self.tree is not None:
            short = n - self.allocator.available_size()
            if short > 0:
                self.tree.evict(short)
            if self.windows is not None and (short := n - self.windows.windows.available_size()) > 0:
                self.tree.evict_windows(short)
        return self.allocator.alloc(n)

    def trim_windows(self, req: Req, first_query: int) -> None:
        """Frees the window slots of req's own tokens (not the tree's) that no query of it from
        position first_query on can see: those before first_query - W + 1."""
        if self.windows is None:
            return
        end = first_query - self.window + 1
        start = max(req.window_from, req.prefix_len)
        if end > start:
            self.windows.drop_windows(req.kv_slots[start:end])
            req.window_from = end

    def window_slots(self, req: Req, start: int, end: int) -> list[int] | None:
        """The window slots of req's tokens [start, end) for the executor's window table (0: none);
        None without window slots."""
        return None if self.windows is None else self.windows.windows_of(req.kv_slots[start:end])

    def take_copies(self) -> list[KVCopy]:
        """Tier moves the tree recorded since the last step, for the next one to run first."""
        return self.tree.take_copies() if self.tree is not None else []

    # -- request lifecycle --------------------------------------------------------------------
    def admit(self, req: Req) -> bool:
        """Gives req a table row and its matched prefix's slots, and pins that prefix. A part of the
        prefix found on the disk tier is read into the host tier first; a part found on the host
        tier is loaded back. What finds no room (or fails its checksum on disk) is left out of the
        prefix (recomputed)."""
        idx = self.rows.alloc()
        if idx is None:
            return False
        req.req_pool_idx = idx
        if self.tree is not None and req.last_node is not None:
            if self.tree.host_allocator is not None:
                # Loading an earlier request's prefix this step may have demoted or dropped part of
                # the match found while waiting: find it again.
                req.prefix_len, req.last_node = self.tree.match_node(req.token_ids[: req.prefix_len])
            # Where the match leaves the device and the host tier: [0, on_device) was in the pool,
            # [in_memory, in_memory + from_disk) is read from disk now, the rest between from the host.
            on_device = req.prefix_len - self.tree.host_suffix(req.last_node)[0]
            in_memory, from_disk = req.prefix_len, 0
            if self.tree.disk_allocator is not None:
                in_memory, from_disk = self._fetch(req)
            host_len, device_node = self.tree.host_suffix(req.last_node)
            if host_len and not self.tree.load(req.last_node):
                req.last_node, req.prefix_len = device_node, req.prefix_len - host_len
            if req.cached_tokens < 0:
                cached = min(req.prefix_len, req.prompt_len)
                device_len = min(on_device, cached)
                disk_len = max(min(cached, in_memory + from_disk) - in_memory, 0)
                self.device_hit_tokens += device_len
                self.disk_hit_tokens += disk_len
                self.host_hit_tokens += cached - device_len - disk_len
            req.load_len = req.disk_len = 0
        if self.window and self.tree is not None and req.last_node is not None:
            # Windows of the match may be on the host tier only (loaded back now), or have gone since
            # it was found (policy.py cut it at the end then).
            if self.tree.host_allocator is not None:
                self.tree.load_windows(req.last_node)
            req.prefix_len, req.last_node = self.tree.window_match(req.prefix_len, req.last_node)
        has_prefix = self.tree is not None and req.last_node is not None and req.prefix_len > 0
        req.kv_slots = self.tree.path_slots(req.last_node) if has_prefix else []
        req.window_from = 0
        req.prefix_len = req.kv_len = len(req.kv_slots)
        req.table_synced = 0
        if req.cached_tokens < 0:
            req.cached_tokens = min(req.kv_len, req.prompt_len)
            if has_prefix:
                self.tree.record_hit(req.last_node)
        if self.tree is not None and req.last_node is not None:
            self.tree.inc_lock_ref(req.last_node)
            if self.window:
                self.tree.lock_window(req.last_node)
        return True

    def prefetch(self, req: Req) -> int:
        """Starts reading the disk-only end of waiting req's match ahead (into the executor's
        memory; the tree is unchanged), so that admitting it later reads no file; the tokens of it
        still being read. Asking again is cheap: what is read or being read is not read again."""
        if self._prefetch is None or self.tree is None or req.last_node is None or not req.disk_len:
            return 0
        slots = self.tree.disk_path_slots(req.last_node)
        return self._prefetch(slots) if slots else 0

    def _fetch(self, req: Req) -> tuple[int, int]:
        """Reads the disk-only end of req's match back (RadixCache.fetch); what finds no room or
        fails its checksum is cut from the match. Returns where the disk-only part began and how
        many of its tokens were read and kept."""
        assert self.tree is not None and self.move is not None and req.last_node is not None
        disk_len, _ = self.tree.disk_suffix(req.last_node)
        if not disk_len:
            return req.prefix_len, 0
        start = req.prefix_len - disk_len
        t0 = time.perf_counter()
        # The nodes read are the top of the disk-only part, each below the one before: what the
        # match keeps of them after failures (which drop everything below) is all of what was read.
        read = self.tree.fetch(req.last_node, self.move)
        self.disk_reads += 1
        self.disk_read_seconds += time.perf_counter() - t0
        # A node that failed its checksum left the tree with everything below it: match again.
        req.prefix_len, req.last_node = self.tree.match_node(req.token_ids[: req.prefix_len])
        disk_len, memory_node = self.tree.disk_suffix(req.last_node)
        if disk_len:
            req.last_node, req.prefix_len = memory_node, req.prefix_len - disk_len
        return start, read

    def cache_unfinished(self, req: Req, computed: int) -> None:
        """Publishes req's first `computed` tokens (a prefill chunk whose step has been read) in the
        tree, so requests sharing them can match them next step, and moves req's lock down to the new
        deepest node. Under overlap scheduling req.kv_len may already count a step still in flight:
        its KV is not published, so a failure of that step frees only slots req alone holds."""
        if self.tree is None or computed == 0:
            return
        ids = req.token_ids[:computed]
        self._insert(req, ids, req.kv_slots[:computed])
        matched, new_node = self.tree.match_node(ids)
        assert matched == computed, "the tree lost tokens that were just inserted"
        self.tree.inc_lock_ref(new_node)
        if self.window:
            self.tree.lock_window(new_node)
        if req.last_node is not None:
            self._unlock(req.last_node)
        req.last_node = new_node
        req.prefix_len = computed

    def finish(self, req: Req) -> None:
        """Releases a finished (or aborted) req; when it belongs to an open session, the whole
        sequence it computed stays pinned for the session's next call."""
        sid = req.session_id
        node = self.release(req, pin=self.sessions.is_open(sid))
        if sid is not None:
            self.sessions.finish(sid, req.rid, node)

    def release(self, req: Req, pin: bool = False) -> TreeNode | None:
        """Ends req's hold on KV memory (finish, retraction or abort): the computed tokens join the
        tree for later reuse (or are freed when the cache is disabled) and the lock is dropped.
        With pin, returns the node ending those tokens locked once more for the caller to hold
        (None when req computed nothing)."""
        if req.req_pool_idx is None:
            return None
        # Slots past kv_len were planned for a step that will not count (a request that finished
        # while its next step was already launched).
        self.allocator.free(req.kv_slots[req.kv_len :])
        slots = req.kv_slots[: req.kv_len]
        pinned: TreeNode | None = None
        if self.tree is None:
            self.allocator.free(slots)
        else:
            ids = req.token_ids[: req.kv_len]
            self._insert(req, ids, slots)
            end = self.tree.match_node(ids)[1] if ids and (pin or self.window) else None
            if self.window and end is not None:
                # Where a next turn's prompt matches to: the end of this sequence, or of its prompt
                # when the next turn quotes another answer than this one's.
                self.tree.mark_tail(end)
                if req.prompt_len < len(ids):
                    self.tree.mark_tail(self.tree.match_node(ids[: req.prompt_len])[1])
            if pin and end is not None:
                # Locked before req's own lock goes, so the path is never evictable in between.
                pinned = end
                self.tree.inc_lock_ref(pinned)
            if req.last_node is not None:
                self._unlock(req.last_node)
        self.rows.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_slots = []
        req.prefix_len = req.kv_len = req.table_synced = 0
        return pinned

    def _unlock(self, node: TreeNode) -> None:
        """Drops a request's locks on the path ending at node (and on its window)."""
        assert self.tree is not None
        if self.window:
            self.tree.unlock_window(node)
        self.tree.dec_lock_ref(node)

    def _insert(self, req: Req, ids: list[int], slots: list[int]) -> None:
        """Inserts ids -> slots. Where the tree already held some of these tokens (another request
        computed them concurrently), req's duplicate slots are freed and req reads the tree's
        from now on (its table row is rewritten from there)."""
        assert self.tree is not None
        n = len(ids)
        logprobs = req.token_logprobs[:n] if req.token_logprobs is not None else None
        top = req.token_top[:n] if req.token_top is not None else None
        already = self.tree.insert(ids, slots, logprobs, top)
        own_from = req.prefix_len
        if already > own_from:
            self.allocator.free(slots[own_from:already])
            tree_slots = self.tree.match_prefix(ids[:already])[0]
            req.kv_slots[own_from:already] = tree_slots[own_from:]
            req.table_synced = min(req.table_synced, own_from)

    def flush(self) -> bool:
        """Drops every cached prefix, session pins included (the sessions stay open); refused while
        requests hold KV."""
        if self.rows.available_size() != self.rows.max_reqs:
            return False
        self.sessions.unpin_all()
        if self.tree is not None:
            self.tree.reset()
        return True
