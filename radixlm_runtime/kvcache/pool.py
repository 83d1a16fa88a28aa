"""KV storage and the allocators that hand out its slots.

The KV cache is token-granular: every token of every running or cached sequence owns one slot in
`KVPool`, and the slot indices (not the KV data) are what the scheduler, the radix cache and the
attention kernels pass around. These are the executor's tensors; the free lists that hand the slots
and rows out are the scheduler's (kvcache/allocator.py).
"""

from __future__ import annotations

import torch

from radixlm_runtime.layers import fused_triton

# Quantized pool dtypes. int8: symmetric, one float32 scale per (slot, kv head) for K and one for V, held
# beside the codes (KVPool.k_scales / v_scales). float8_e4m3fn (CUDA, sm89+): the values cast, no scale.
INT8 = torch.int8
FP8 = torch.float8_e4m3fn
# Pool dtypes that are not arithmetic dtypes: read dequantized (int8) or cast (fp8) to the queries'.
QUANTIZED_KV_DTYPES = (INT8, FP8)
# The largest |value| float8_e4m3fn holds; larger K/V are clamped to it (a cast would give NaN).
FP8_MAX = 448.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, H, D] as int8 codes [n, H, D] and float32 scales [n, H]: scale = max |x| / 127 over each
    head's D values, code = x / scale rounded to nearest even (0 where the head is all zeros). The C++
    store (ca_store_kv) computes the same bits."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x scale in float32, then cast to dtype: the K/V an int8 pool stands for (the torch backend
    and Triton kernels compute with these; the C++ kernels apply the scales once per key, within float32
    rounding of them)."""
    return (codes.float() * scale.float()[..., None]).to(dtype)


class KVPool:
    """One preallocated token-granular K and V buffer per layer, of `dtype`: the model's, bfloat16 under
    bf16 arithmetic on the CPU (executor/memory.py's kv_dtype_for), whose float32 K/V are rounded to bf16
    as they are stored, or a quantized one (--kv-cache-dtype): int8 codes with a float32 scale per (slot,
    kv head) for K and for V (k_scales / v_scales, [slots, Hkv]), or float8_e4m3fn.

    Every tensor the pool holds is in `tensors()` (per layer: K, V, then K's and V's scales where it has
    them), and those of token slots or of window slots in `part_tensors`, so tier code copies or saves
    a pool generically.

    Slot 0 is a dummy slot that padded positions write to / read from, so real slots are 1..size.

    Sliding-window layers (`window_layers`) may keep their K/V in `window_size` slots of their own
    instead: a token's KV in those layers is needed only while a query within the window can see it,
    so they hold a window's worth per sequence (plus what the radix tree keeps) rather than every
    token. Their slots are handed out beside the token's own (kvcache/allocator.py's
    WindowedAllocator); the attention of those layers reads them through a second table.
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
        window_layers: frozenset[int] = frozenset(),
        window_size: int = 0,
    ) -> None:
        if window_layers and window_size <= 0:
            raise ValueError(f"a KV pool with window layers needs window_size > 0, got {window_size}")
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
        self.quantized = dtype == INT8
        self.window_layers = frozenset(window_layers)
        self.window_size = window_size if window_layers else 0

        # torch.empty so CPU pages are only committed when first written; slot 0 is zeroed because
        # padded positions read it and garbage (possibly NaN) there would poison masked softmax sums.
        def buffers(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            out = []
            for layer in range(num_layers):
                rows = (window_size if layer in self.window_layers else size) + 1
                buf = torch.empty((rows, *shape), dtype=dtype, device=self.device, pin_memory=pin_memory)
                buf[0].zero_()
                out.append(buf)
            return out

        self.k_buffers = buffers((num_kv_heads, head_dim), dtype)
        self.v_buffers = buffers((num_kv_heads, head_dim), dtype)
        # int8: the scales of each slot's heads ([slots, Hkv] float32 per layer); empty otherwise.
        self.k_scales = buffers((num_kv_heads,), torch.float32) if self.quantized else []
        self.v_scales = buffers((num_kv_heads,), torch.float32) if self.quantized else []

    @property
    def windowed(self) -> bool:
        """Whether some layers keep their KV in window slots of their own."""
        return bool(self.window_layers)

    def layer_tensors(self, layer_id: int) -> list[torch.Tensor]:
        """Every tensor of one layer, each indexed by slot first: K, V, and (int8) their scales."""
        out = [self.k_buffers[layer_id], self.v_buffers[layer_id]]
        if self.quantized:
            out += [self.k_scales[layer_id], self.v_scales[layer_id]]
        return out

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool holds, layer by layer (layer_tensors'), each indexed by slot first: what
        a tier copies for a slot is row `slot` of each."""
        return [t for layer in range(self.num_layers) for t in self.layer_tensors(layer)]

    def part_tensors(self, window: bool) -> list[torch.Tensor]:
        """The tensors indexed by window slots (`window`: the sliding-window layers') or by token
        slots (every other layer's; every layer's in a pool without window slots)."""
        return [t for _, t in self.named_tensors(window)]

    def named_tensors(self, window: bool = False) -> list[tuple[str, torch.Tensor]]:
        """part_tensors(window) with names (k0, v0, [k_scale0, v_scale0,] k1, ...): what a disk tier
        entry lists it stores."""
        names = ("k", "v", "k_scale", "v_scale")
        return [
            (f"{names[i]}{layer}", t)
            for layer in range(self.num_layers)
            if (layer in self.window_layers) == window
            for i, t in enumerate(self.layer_tensors(layer))
        ]

    def gather(self, slots: list[int], window: bool = False) -> list[torch.Tensor]:
        """Copies of the rows at `slots` of every tensor of part_tensors(window), on the CPU."""
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return [t.index_select(0, idx).cpu() for t in self.part_tensors(window)]

    def scatter(self, slots: list[int], rows: list[torch.Tensor], window: bool = False) -> None:
        """Writes rows (as `gather` returns them) into `slots` (none twice) of part_tensors(window)."""
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        non_blocking = self.device.type == "cuda"
        for mine, r in zip(self.part_tensors(window), rows, strict=True):
            mine.index_copy_(0, idx, r.to(self.device, mine.dtype, non_blocking=non_blocking))

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the new tokens' K/V (each [n, H, D]) into slots `loc` ([n] int64) of one layer,
        quantized for an int8 pool (quantize_int8). On CUDA one kernel stores and casts both (index_put
        and the casts would be several launches)."""
        k_buf = self.k_buffers[layer_id]
        v_buf = self.v_buffers[layer_id]
        if self.quantized:
            for buf, scales, x in ((k_buf, self.k_scales[layer_id], k), (v_buf, self.v_scales[layer_id], v)):
                codes, scale = quantize_int8(x)
                buf[loc] = codes
                scales[loc] = scale
            return
        if self.dtype == FP8:
            k_buf[loc] = k.clamp(-FP8_MAX, FP8_MAX).to(FP8)
            v_buf[loc] = v.clamp(-FP8_MAX, FP8_MAX).to(FP8)
            return
        if fused_triton.supports(k) and fused_triton.supports(v) and fused_triton.supports(k_buf):
            fused_triton.store_kv(k_buf, v_buf, loc, k, v)
            return
        k_buf[loc] = k.to(k_buf.dtype)
        v_buf[loc] = v.to(v_buf.dtype)

    def read_kv(
        self, layer_id: int, slots: torch.Tensor | slice, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([n, Hkv, D], dtype) of one layer's `slots` (an index tensor, or a slice read as a
        view): gathered, then widened or dequantized, so only those rows are ever copied, never the
        pool."""

        def rows(buf: torch.Tensor) -> torch.Tensor:
            return buf[slots] if isinstance(slots, slice) else buf.index_select(0, slots)

        def read(codes: list[torch.Tensor], scales: list[torch.Tensor]) -> torch.Tensor:
            if not self.quantized:
                return rows(codes[layer_id]).to(dtype)
            return dequantize_int8(rows(codes[layer_id]), rows(scales[layer_id]), dtype)

        return read(self.k_buffers, self.k_scales), read(self.v_buffers, self.v_scales)

    def copy_from(self, other: KVPool, src: list[int], dst: list[int], window: bool = False) -> None:
        """Every tensor (K, V, and an int8 pool's scales) of other's slots `src` into this pool's slots
        `dst` (between the device pool and the host tier, either way; `dst` holds no slot twice), in this
        pool's dtype: token slots' tensors, or with `window` window slots' (part_tensors). The tiers
        share one dtype and one set of window layers, so each is a plain copy of what the pool stores;
        an int8 pool copies only to and from another."""
        if other.dtype != self.dtype and (self.quantized or other.quantized):
            raise ValueError(f"KV copy from a {other.dtype} pool to a {self.dtype} one: int8 only to int8")
        if other.window_layers != self.window_layers:
            raise ValueError("KV copy between pools with different window layers")
        src_idx = torch.tensor(src, dtype=torch.int64, device=other.device)
        dst_idx = torch.tensor(dst, dtype=torch.int64, device=self.device)
        # Into the GPU asynchronously; out of it synchronously, since the host scatter reads the data.
        # index_select / index_copy_ move whole rows: on CPU twice the speed of indexing (x[i] = y[j]
        # goes element by element), which every host-tier load and write-back pays.
        non_blocking = self.device.type == "cuda"
        for mine, theirs in zip(self.part_tensors(window), other.part_tensors(window), strict=True):
            rows = theirs.index_select(0, src_idx).to(self.device, mine.dtype, non_blocking=non_blocking)
            mine.index_copy_(0, dst_idx, rows)

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Lets the engine size the pool from free memory before any buffer exists: K and V, and an
        int8 pool's float32 scale per kv head for each."""
        element_size = torch.empty((), dtype=dtype).element_size()
        scales = 4 if dtype == INT8 else 0
        return 2 * num_layers * num_kv_heads * (head_dim * element_size + scales)

    def bytes_per_token(self) -> int:
        """Bytes of one token slot: every layer's, or with window layers, the other layers' only."""
        layers = self.num_layers - len(self.window_layers)
        return self.bytes_per_token_for(layers, self.num_kv_heads, self.head_dim, self.dtype)

    def bytes_per_window_slot(self) -> int:
        return self.bytes_per_token_for(len(self.window_layers), self.num_kv_heads, self.head_dim, self.dtype)


class ReqToTokenTable:
    """Maps a request's row to the KV pool slots of its tokens, on the device.

    Attention reads a request's KV through its row instead of a contiguous copy. Rows are handed
    out by the scheduler's RowAllocator; the executor writes them from each step's plan. With
    `windowed`, a second table of the same shape holds each token's window slot, through which the
    sliding-window layers of a windowed pool read (0 where a token has none: out of every window).
    """

    def __init__(
        self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu", windowed: bool = False
    ) -> None:
        if max_reqs <= 0 or max_context_len <= 0:
            raise ValueError(
                f"ReqToTokenTable dimensions must be positive, got {max_reqs=}, {max_context_len=}"
            )
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=device)
        self.req_to_window = torch.zeros_like(self.req_to_token) if windowed else None

    def write(
        self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor, window: torch.Tensor | None = None
    ) -> None:
        """One scatter for every (row, position) -> slot entry a step changes (and one for their
        window slots)."""
        self.req_to_token[rows, cols] = slots
        if window is not None:
            assert self.req_to_window is not None, "window slots for a table without a window table"
            self.req_to_window[rows, cols] = window
