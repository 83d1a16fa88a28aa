"""Attention for float32 on the CPU in C++ (cpu_attention.cpp, built by kernels/native.py), over a KV pool
of float32, (--dtype bfloat16, --kv-cache-dtype bfloat16) bf16 or (--kv-cache-dtype int8) int8. bf16:
K/V rounded to bf16 as they are stored and widened back as they are read, the scores then dot products
of bf16 operands (the queries rounded too) accumulated in float32; on prefill chunks, where the CPU has
AVX512-BF16 and runs it fast (default_mode), both the scores and P.V (the weights rounded to bf16) by
vdpbf16ps, 1.5x float32 on a Zen 4 (not on a Zen 5, whose full-width FMAs make float32 faster);
where it has AMX-BF16, both on AMX tiles (~2x on a Xeon). int8:
K/V quantized per token and kv head as they are stored (pool.py's quantize_int8), the codes converted to
float32 in registers on decode and per block of keys on prefill, never as a copy of the pool, and the
scales applied once per key (scores = k_scale x q . codes, weights x v_scale): within float32 rounding of
attention over the dequantized values. Softmax and P.V in float32.

Per layer the torch backend spends much of a step outside arithmetic: index_put of the new K/V,
index_select gathers of every request's K/V, then torch's flash kernel, which with a cached prefix
takes a mask and computes the causally hidden blocks too. Here the store is a row copy and the whole
step's attention (decode tokens, extends, prefill chunks) is one C++ call that reads K/V in place
through the request-to-token table: 1.3-2x faster than SDPA over gathered K/V on prefill shapes, ~4x
on decode (idle 2-core Zen 4). Sliding windows and logit soft-caps run in the same kernels (a window's
tokens read only its keys), where the torch backend falls back to a per-request float32 path.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from radixlm_runtime.attention.base import AttentionBackend, AttentionLayer
from radixlm_runtime.attention.torch_backend import MIN_SHARED_PREFIX, shared_prefix_groups
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.kernels.native import load_library
from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenTable
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.cpp")
# Kernel modes: the portable loop; AVX2+FMA; AVX-512 for prefill chunks and group items of 48 rows or
# more (of 9 or more where zmm FMAs run at full width; the rest on AVX2); that and, over a bf16 pool,
# those items' scores and P.V by vdpbf16ps (AVX512-BF16); AVX-512 with a bf16 pool's prefill chunks on
# AMX tiles (AMX-BF16, D a multiple of 32). Each runs where the CPU has it and D is whole 8-float
# vectors, else the one below (AMX_BF16: AVX512).
SCALAR, AVX2, AVX512, AVX512_BF16, AMX_BF16 = 0, 1, 2, 3, 4
# vdpbf16ps's flop rate over float32 FMAs' from which the bf16 path is the default: it does layout work
# the float32 path does not (queries, V and the weights in pairs), so at the FMAs' rate it loses (a
# Sapphire Rapids Xeon, 0.44x: prefill attention 0.77x the float32 path's; a Zen 4, 2x: 1.5x).
BF16_DOT_MIN_RATIO = 1.5
# The KV pool dtypes the kernels read and write, as cpu_attention.cpp's KvType numbers them.
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


@functools.cache
def _library() -> ctypes.CDLL:
    """The built library; raises KernelBuildError where it cannot be built."""
    lib = load_library(_SOURCE)
    i64, ptr, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.ca_has_avx2_fma.restype = c_int
    lib.ca_has_avx512.restype = c_int
    lib.ca_has_avx512_bf16.restype = c_int
    lib.ca_has_amx_bf16.restype = c_int
    lib.ca_bf16_dot_over_fma.restype = ctypes.c_double
    lib.ca_fma_zmm_over_ymm.restype = ctypes.c_double
    lib.ca_full_width_zmm.restype = c_int
    lib.ca_select_path.argtypes = [c_int, c_int, c_int, c_int, c_int, i64]
    lib.ca_select_path.restype = c_int
    lib.ca_store_kv.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, c_int, c_int]
    lib.ca_store_kv.restype = None
    # q, its stride, out, its stride, k_buf, v_buf, their scales, their KV type, Hq, Hkv, D, table, its
    # stride, requests, B, groups, their count, members, scale, window, softcap, mode, threads
    lib.ca_decode.argtypes = [ptr, i64, ptr, i64, *[ptr] * 4, c_int, *[i64] * 3, ptr, i64, ptr, i64]
    lib.ca_decode.argtypes += [ptr, i64, ptr, f32, i64, f32, c_int, c_int]
    lib.ca_decode.restype = None
    return lib


def kernel_path(
    head_dim: int,
    mode: int = AVX512_BF16,
    cpu_has_avx2_fma: bool | None = None,
    cpu_has_avx512: bool | None = None,
    cpu_has_avx512_bf16: bool | None = None,
    cpu_has_amx_bf16: bool | None = None,
) -> int:
    """The path the kernels run for `mode` on a CPU with the given features (this one's, asked of the
    CPU, where None): the C++ side's own choice, so a fake feature set tests it."""
    lib = _library()
    avx2 = lib.ca_has_avx2_fma() if cpu_has_avx2_fma is None else int(cpu_has_avx2_fma)
    avx512 = lib.ca_has_avx512() if cpu_has_avx512 is None else int(cpu_has_avx512)
    bf16 = lib.ca_has_avx512_bf16() if cpu_has_avx512_bf16 is None else int(cpu_has_avx512_bf16)
    amx = lib.ca_has_amx_bf16() if cpu_has_amx_bf16 is None else int(cpu_has_amx_bf16)
    return lib.ca_select_path(mode, avx2, avx512, bf16, amx, head_dim)


@functools.cache
def default_mode() -> int:
    """The widest mode that pays on this CPU: AMX_BF16 where the CPU has AMX-BF16 tiles (a bf16 pool's
    prefill on tiles: ~2x the float32 FMAs on a Sapphire Rapids Xeon, benchmarks/README.md);
    AVX512_BF16 where vdpbf16ps outruns the float32 FMAs by BF16_DOT_MIN_RATIO and those FMAs issue
    zmm at ymm's rate (both timed once by the library): full-width 512-bit units double float32
    arithmetic but not the bf16 path's layout work (a Zen 5, 2x: the bf16 path 0.72-0.79x the float32
    one, where a Zen 4, 1x, ran it at 1.5x); else AVX512 (the C++ side then steps down to what the CPU
    has). Logged when the CPU has bf16 dot products that do not pay."""
    lib = _library()
    if lib.ca_has_amx_bf16():
        return AMX_BF16
    ratio = lib.ca_bf16_dot_over_fma()
    if ratio <= 0:
        return AVX512
    full_width = lib.ca_full_width_zmm()
    if ratio >= BF16_DOT_MIN_RATIO and not full_width:
        return AVX512_BF16
    logger.info(
        "CPU attention: bf16 pools widened to float32 on prefill: vdpbf16ps runs at %.2fx the float32 FMAs' "
        "flops and zmm FMAs at %.2fx ymm ones here (the bf16 path needs >= %.1fx, and zmm FMAs split in "
        "halves)",
        ratio,
        lib.ca_fma_zmm_over_ymm(),
        BF16_DOT_MIN_RATIO,
    )
    return AVX512


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] float32 with each row's H * D floats contiguous (a fused projection's split
    views are): the kernels take a row stride, so only other layouts are copied."""
    if x.dtype != torch.float32:
        raise ValueError(f"the C++ CPU attention is float32 only, got {x.dtype}")
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def kv_type(buf: torch.Tensor) -> int:
    """The kernels' number for a KV buffer's dtype; a ValueError for one they do not read."""
    if buf.dtype not in KV_TYPES or buf.device.type != "cpu":
        raise ValueError(
            f"the C++ CPU attention reads float32, bfloat16 or int8 KV on the CPU, got {buf.dtype} on "
            f"{buf.device}"
        )
    return KV_TYPES[buf.dtype]


def layer_pointers(pool: KVPool, layer_id: int) -> tuple[int, int, int, int]:
    """One layer's K, V, K-scale and V-scale addresses as the kernels take them (scales 0: not int8)."""
    k_scale, v_scale = (pool.k_scales[layer_id], pool.v_scales[layer_id]) if pool.quantized else (None, None)
    return (
        pool.k_buffers[layer_id].data_ptr(),
        pool.v_buffers[layer_id].data_ptr(),
        0 if k_scale is None else k_scale.data_ptr(),
        0 if v_scale is None else v_scale.data_ptr(),
    )


def store_kv(pool: KVPool, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What KVPool.set_kv does (a bf16 pool's K/V rounded to nearest even as .to(torch.bfloat16) rounds,
    an int8 pool's quantized as quantize_int8 quantizes) as one row write per token."""
    k, v = _rows(k), _rows(v)
    _library().ca_store_kv(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        loc.data_ptr(),
        loc.shape[0],
        k.shape[1],
        k.shape[2],
        *layer_pointers(pool, layer_id),
        kv_type(pool.k_buffers[layer_id]),
        torch.get_num_threads(),
    )


@dataclass
class StepRequests:
    """A step's attention work for the kernel (see ca_decode in cpu_attention.cpp)."""

    requests: torch.Tensor  # int64 [4, B]: req_to_token rows, sequence lengths, first q rows, new tokens
    # int64 [3, G]: offsets into members, member counts, shared prefix lengths; None: no groups
    groups: torch.Tensor | None = None
    members: torch.Tensor | None = None  # int64: request indices, each group's together

    def args(self) -> tuple[int, int, int, int, int | None]:
        """(requests, B, groups, G, members) as the C++ entry points take them."""
        if self.groups is None or self.members is None:
            return self.requests.data_ptr(), self.requests.shape[1], None, 0, None
        return (
            self.requests.data_ptr(),
            self.requests.shape[1],
            self.groups.data_ptr(),
            self.groups.shape[1],
            self.members.data_ptr(),
        )


def prefix_groups(
    slots: list[list[int]], extend_lens: list[int]
) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """Decoding requests (one new token) that share a prefix (a few-shot prefix or system prompt the
    radix cache shares), as the kernel takes them: (member offsets, member counts, shared prefix
    lengths, members)."""
    # Too short to share MIN_SHARED_PREFIX slots: left out, so they cannot shrink a group's prefix.
    decoding = [
        b for b, (seq, n) in enumerate(zip(slots, extend_lens)) if n == 1 and len(seq) > MIN_SHARED_PREFIX
    ]
    offsets: list[int] = []
    counts: list[int] = []
    lengths: list[int] = []
    members: list[int] = []
    for group, shared in shared_prefix_groups([slots[b] for b in decoding], [1] * len(decoding)):
        offsets.append(len(members))
        counts.append(len(group))
        lengths.append(shared)
        members += [decoding[i] for i in group]
    return (offsets, counts, lengths, members) if members else None


def decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    pool: KVPool,
    layer_id: int,
    req_to_token: torch.Tensor,
    step: StepRequests,
    scale: float,
    mode: int = AVX512_BF16,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Writes the rows of out [T, Hq, D] that `step`'s requests own: each new token's causal attention
    over its request's KV in the pool's layer `layer_id` (float32, bfloat16 or int8), read through its
    req_to_token row; with a sliding window of `window` keys and scores soft-capped at `softcap` where
    they are not 0."""
    q = _rows(q)
    if out.stride(2) != 1 or out.stride(1) != out.shape[2]:
        raise ValueError("out rows must be contiguous")
    _library().ca_decode(
        q.data_ptr(),
        q.stride(0),
        out.data_ptr(),
        out.stride(0),
        *layer_pointers(pool, layer_id),
        kv_type(pool.k_buffers[layer_id]),
        q.shape[1],
        pool.num_kv_heads,
        q.shape[2],
        req_to_token.data_ptr(),
        req_to_token.stride(0),
        *step.args(),
        scale,
        window,
        softcap,
        mode,
        torch.get_num_threads(),
    )


class CpuAttentionBackend(AttentionBackend):
    """Float32, bfloat16 or int8 KV on the CPU only. `mode` picks another kernel path than the one that
    pays on this CPU (default_mode; tests)."""

    supports_per_token = True
    supports_sliding_window = True
    supports_logit_softcap = True

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token_table: ReqToTokenTable,
        layers: Sequence[AttentionLayer],
        mode: int | None = None,
    ) -> None:
        if kv_pool.dtype not in KV_TYPES or kv_pool.device.type != "cpu":
            raise ValueError(
                f"the cpu attention backend needs a float32, bfloat16 or int8 KV pool on the CPU, got "
                f"{kv_pool.dtype} on {kv_pool.device}; use attention_backend='torch'"
            )
        super().__init__(kv_pool, req_to_token_table, layers)
        _library()  # built now, so a missing compiler fails at start-up
        self.mode = default_mode() if mode is None else mode

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """The kernel's work: every request of the step, decode or prefill chunk, and the groups of
        decoding requests that share a prefix (not under --deterministic: a token's result must not
        depend on who shares its prefix). Per layer the kernel leaves out a group whose prefix a
        member's sliding window does not wholly hold."""
        if self.per_token:
            rows, lens = self.per_token_decodes(batch)
            n = len(rows)
            requests = torch.tensor((rows, lens, list(range(n)), [1] * n), dtype=torch.int64)
            batch.attn_metadata = StepRequests(requests)
            return
        lists = (
            batch.req_pool_indices_cpu,
            batch.seq_lens_cpu,
            batch.extend_start_loc_cpu,
            batch.extend_lens_cpu,
        )
        step = StepRequests(torch.tensor(lists, dtype=torch.int64))
        groups = prefix_groups(batch.seq_slots_cpu, batch.extend_lens_cpu)
        if groups is not None:
            offsets, counts, lengths, members = groups
            step.groups = torch.tensor((offsets, counts, lengths), dtype=torch.int64)
            step.members = torch.tensor(members, dtype=torch.int64)
        batch.attn_metadata = step

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        store_kv(self.kv_pool, layer_id, self.loc_of(layer_id, batch), k, v)
        return self.attend(q, layer_id, batch)

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        layer = self.layers[layer_id]
        decode_attention(
            q,
            out,
            self.kv_pool,
            layer_id,
            self.table_of(layer_id),
            batch.attn_metadata,
            layer.scale,
            self.mode,
            layer.sliding_window or 0,
            layer.logit_softcap or 0.0,
        )
        return out
