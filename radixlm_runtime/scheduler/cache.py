"""Glue between requests and the KV memory: the radix tree, the slot allocator, the
request-to-token table and the program sessions pinning KV. Every slot a request touches is
accounted for here, so that when a request finishes, is retracted or is aborted its slots either
join the tree or return to the free list."""

from __future__ import annotations

import torch

from radixlm_runtime.kvcache.pool import ReqToTokenPool, TokenAllocator
from radixlm_runtime.kvcache.radix_cache import RadixCache, TreeNode
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.scheduler.session import SessionTable


class CacheManager:
    def __init__(
        self,
        allocator: TokenAllocator,
        req_to_token_pool: ReqToTokenPool,
        disable_radix_cache: bool,
        session_timeout_s: float = 60.0,
        session_pin_fraction: float = 0.5,
    ) -> None:
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.tree = None if disable_radix_cache else RadixCache(allocator)
        self.sessions = SessionTable(self.tree, session_timeout_s, int(session_pin_fraction * allocator.size))

    # -- capacity -----------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Slots that can be handed out now: free ones plus unlocked ones the tree can evict."""
        evictable = self.tree.evictable_size() if self.tree is not None else 0
        return self.allocator.available_size() + evictable

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.req_to_token.device)
        short = n - self.allocator.available_size()
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.allocator.alloc(n)

    # -- request lifecycle --------------------------------------------------------------------
    def admit(self, req: Req) -> bool:
        """Gives req a row in the request-to-token table and pins its matched prefix."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return False
        req.req_pool_idx = idx
        n = len(req.prefix_indices)
        if n:
            self.req_to_token[idx, :n] = req.prefix_indices
        req.kv_len = n
        if req.cached_tokens < 0:
            req.cached_tokens = min(n, req.prompt_len)
        if self.tree is not None and req.last_node is not None:
            self.tree.inc_lock_ref(req.last_node)
        return True

    def cache_unfinished(self, req: Req) -> None:
        """Publishes the KV computed so far (a finished prefill chunk) in the tree, so requests
        sharing it can match it next step, and moves req's lock down to the new deepest node."""
        if self.tree is None or req.kv_len == 0:
            return
        ids = req.fill_ids[: req.kv_len]
        slots = self.req_to_token[req.req_pool_idx, : req.kv_len].clone()
        self._insert(req, ids, slots)
        new_indices, new_node = self.tree.match_prefix(ids)
        assert len(new_indices) == req.kv_len, "the tree lost tokens that were just inserted"
        self.req_to_token[req.req_pool_idx, : req.kv_len] = new_indices
        self.tree.inc_lock_ref(new_node)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node = new_node
        req.prefix_indices = new_indices

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
        slots = self.req_to_token[req.req_pool_idx, : req.kv_len].clone()
        pinned: TreeNode | None = None
        if self.tree is None:
            self.allocator.free(slots)
        else:
            ids = req.fill_ids[: req.kv_len]
            self._insert(req, ids, slots)
            if pin and ids:
                # Locked before req's own lock goes, so the path is never evictable in between.
                _, pinned = self.tree.match_prefix(ids)
                self.tree.inc_lock_ref(pinned)
            if req.last_node is not None:
                self.tree.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.kv_len = 0
        return pinned

    def _insert(self, req: Req, ids: list[int], slots: torch.Tensor) -> None:
        """Inserts ids -> slots; where the tree already held some of these tokens (another request
        computed them concurrently), req's duplicate slots are freed."""
        assert self.tree is not None
        already = self.tree.insert(ids, slots)
        own_from = len(req.prefix_indices)
        if already > own_from:
            self.allocator.free(slots[own_from:already])

    def flush(self) -> bool:
        """Drops every cached prefix, session pins included (the sessions stay open); refused while
        requests hold KV."""
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.max_reqs:
            return False
        self.sessions.unpin_all()
        if self.tree is not None:
            self.tree.reset()
        return True
