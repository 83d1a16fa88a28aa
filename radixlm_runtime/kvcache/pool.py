"""KV storage and the allocators that hand out its slots.

The KV cache is token-granular: every token of every running or cached sequence owns one slot in
`KVPool`, and the slot indices (not the KV data) are what the scheduler, the radix cache and the
attention kernels pass around.
"""

from __future__ import annotations

import torch


class KVPool:
    """One preallocated token-granular K and V buffer per layer.

    Slot 0 is a dummy slot that padded positions write to / read from, so real slots are 1..size.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if size <= 0 or num_layers <= 0 or num_kv_heads <= 0 or head_dim <= 0:
            raise ValueError(
                f"KVPool dimensions must be positive, got size={size}, num_layers={num_layers}, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)
        # torch.empty so CPU pages are only committed when first written; slot 0 is zeroed because
        # padded positions read it and garbage (possibly NaN) there would poison masked softmax sums.
        self.k_buffers: list[torch.Tensor] = []
        self.v_buffers: list[torch.Tensor] = []
        for _ in range(num_layers):
            k = torch.empty(shape, dtype=dtype, device=self.device)
            v = torch.empty(shape, dtype=dtype, device=self.device)
            k[0].zero_()
            v[0].zero_()
            self.k_buffers.append(k)
            self.v_buffers.append(v)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the new tokens' K/V (each [n, H, D]) into slots `loc` ([n] int64) of one layer."""
        k_buf = self.k_buffers[layer_id]
        v_buf = self.v_buffers[layer_id]
        k_buf[loc] = k.to(k_buf.dtype)
        v_buf[loc] = v.to(v_buf.dtype)

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Lets the engine size the pool from free memory before any buffer exists."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * element_size

    def bytes_per_token(self) -> int:
        return self.bytes_per_token_for(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)


class TokenAllocator:
    """Free list of KV slots 1..size.

    Frees are validated: freeing a slot twice or a slot that is not allocated raises (cheap enough: a
    bool tensor of allocation state), so leaks/double frees surface in tests.
    """

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        if size <= 0:
            raise ValueError(f"TokenAllocator size must be positive, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        self._free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        # Freed slots are parked here unsorted and merged into `_free_slots` only when it runs short,
        # so a free is a cheap append and allocation still favours low, mostly contiguous slots.
        self._released: list[torch.Tensor] = []
        self._num_released = 0
        self._allocated = torch.zeros(self.size + 1, dtype=torch.bool, device=self.device)

    def available_size(self) -> int:
        return self._free_slots.numel() + self._num_released

    def alloc(self, n: int) -> torch.Tensor | None:
        """Returns n slots (int64), or None without allocating anything when fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > self.available_size():
            return None
        if n > self._free_slots.numel():
            self._merge_released()
        out = self._free_slots[:n]
        self._free_slots = self._free_slots[n:]
        self._allocated[out] = True
        return out

    def free(self, indices: torch.Tensor) -> None:
        """Returns slots to the free list; raises RuntimeError on a double free or an invalid slot."""
        if indices.numel() == 0:
            return
        # A private copy: callers often pass views of tables they later overwrite (req_to_token rows).
        idx = indices.reshape(-1).to(device=self.device, dtype=torch.int64).clone()
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 1 or hi > self.size:
            raise RuntimeError(f"freeing slot outside 1..{self.size} (got range {lo}..{hi})")
        if not bool(self._allocated[idx].all()):
            bad = idx[~self._allocated[idx]].tolist()
            raise RuntimeError(f"freeing slots that are not allocated (double free?): {bad[:16]}")
        if torch.unique(idx).numel() != idx.numel():
            raise RuntimeError("freeing the same slot twice in one call")
        self._allocated[idx] = False
        self._released.append(idx)
        self._num_released += idx.numel()

    def _merge_released(self) -> None:
        if not self._released:
            return
        merged = torch.cat([self._free_slots, *self._released])
        self._free_slots = torch.sort(merged).values
        self._released = []
        self._num_released = 0


class ReqToTokenPool:
    """Maps a running request's slot to the KV pool indices of its tokens.

    Attention reads a request's KV through one row of this table instead of a contiguous copy.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        if max_reqs <= 0 or max_context_len <= 0:
            raise ValueError(
                f"ReqToTokenPool dimensions must be positive, got {max_reqs=}, {max_context_len=}"
            )
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=self.device)
        self.clear()

    def clear(self) -> None:
        # Reversed so pop() hands out the lowest free row first.
        self._free_rows: list[int] = list(range(self.max_reqs - 1, -1, -1))
        self._in_use = [False] * self.max_reqs

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        idx = self._free_rows.pop()
        self._in_use[idx] = True
        return idx

    def free(self, idx: int) -> None:
        if not 0 <= idx < self.max_reqs:
            raise RuntimeError(f"request slot {idx} outside 0..{self.max_reqs - 1}")
        if not self._in_use[idx]:
            raise RuntimeError(f"request slot {idx} is not allocated (double free?)")
        self._in_use[idx] = False
        self._free_rows.append(idx)
