"""KV storage and the allocators that hand out its slots.

The KV cache is token-granular: every token of every running or cached sequence owns one slot in
`KVPool`, and the slot indices (not the KV data) are what the scheduler, the radix cache and the
attention kernels pass around. These are the executor's tensors; the free lists that hand the slots
and rows out are the scheduler's (kvcache/allocator.py).
"""

from __future__ import annotations

import torch

from radixlm_runtime.layers import fused_triton


class KVPool:
    """One preallocated token-granular K and V buffer per layer, of `dtype`: the model's, or bfloat16
    under bf16 arithmetic on the CPU (executor/memory.py's kv_dtype_for), whose float32 K/V are rounded
    to bf16 as they are stored.

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
        pin_memory: bool = False,
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
            k = torch.empty(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)
            v = torch.empty(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)
            k[0].zero_()
            v[0].zero_()
            self.k_buffers.append(k)
            self.v_buffers.append(v)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the new tokens' K/V (each [n, H, D]) into slots `loc` ([n] int64) of one layer. On CUDA
        one kernel stores and casts both (index_put and the casts would be several launches)."""
        k_buf = self.k_buffers[layer_id]
        v_buf = self.v_buffers[layer_id]
        if fused_triton.supports(k) and fused_triton.supports(v) and fused_triton.supports(k_buf):
            fused_triton.store_kv(k_buf, v_buf, loc, k, v)
            return
        k_buf[loc] = k.to(k_buf.dtype)
        v_buf[loc] = v.to(v_buf.dtype)

    def token_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every buffer indexed by slot, named: what a tier copies and stores per token."""
        return [(f"k{i}", k) for i, k in enumerate(self.k_buffers)] + [
            (f"v{i}", v) for i, v in enumerate(self.v_buffers)
        ]

    def gather(self, slots: list[int]) -> list[torch.Tensor]:
        """Copies of every per-token tensor's rows at `slots`, on the CPU, in token_tensors order."""
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return [t[idx].cpu() for _, t in self.token_tensors()]

    def scatter(self, slots: list[int], rows: list[torch.Tensor]) -> None:
        """Writes rows (token_tensors order, as `gather` returns them) into `slots` (none twice)."""
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        non_blocking = self.device.type == "cuda"
        for (_, mine), r in zip(self.token_tensors(), rows, strict=True):
            mine[idx] = r.to(self.device, mine.dtype, non_blocking=non_blocking)

    def copy_from(self, other: KVPool, src: list[int], dst: list[int]) -> None:
        """Every per-token tensor of other's slots `src` into this pool's slots `dst` (between the
        device pool and the host tier, either way; `dst` holds no slot twice), in this pool's dtype (the
        tiers share one, so that is a plain copy)."""
        src_idx = torch.tensor(src, dtype=torch.int64, device=other.device)
        dst_idx = torch.tensor(dst, dtype=torch.int64, device=self.device)
        pairs = zip(self.token_tensors(), other.token_tensors(), strict=True)
        # Into the GPU asynchronously; out of it synchronously, since the host scatter reads the data.
        non_blocking = self.device.type == "cuda"
        for (_, mine), (_, theirs) in pairs:
            mine[dst_idx] = theirs[src_idx].to(self.device, mine.dtype, non_blocking=non_blocking)

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Lets the engine size the pool from free memory before any buffer exists."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * element_size

    def bytes_per_token(self) -> int:
        return self.bytes_per_token_for(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)


class ReqToTokenTable:
    """Maps a request's row to the KV pool slots of its tokens, on the device.

    Attention reads a request's KV through its row instead of a contiguous copy. Rows are handed
    out by the scheduler's RowAllocator; the executor writes them from each step's plan.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        if max_reqs <= 0 or max_context_len <= 0:
            raise ValueError(
                f"ReqToTokenTable dimensions must be positive, got {max_reqs=}, {max_context_len=}"
            )
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=device)

    def write(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """One scatter for every (row, position) -> slot entry a step changes."""
        self.req_to_token[rows, cols] = slots
