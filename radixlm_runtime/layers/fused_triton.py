"""Triton kernels for the decoder layer's elementwise ops on CUDA tensors: RMSNorm with the residual
add, rotary in place, SiLU-and-mul, and the KV store, one launch each; and the batch-invariant matmul
that --deterministic runs the linears on.

On a GPU these ops are launch-bound, not bandwidth-bound: written as torch ops each costs several
kernel launches (casts, reductions, index_put), most of a small model's per-layer time at decode.
The layers call these where `supports` says so and keep their torch code as the reference (and the
path for other devices and dtypes). Every kernel computes in float32 and rounds where the reference
does, so results match it up to float32 summation order. The device code is in triton_elementwise.py
and triton_matmul.py, imported on first launch, so a CPU process never loads Triton.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels serve x: a CUDA tensor of a dtype they take, rows of contiguous elements."""
    return x.is_cuda and x.dtype in _DTYPES and x.stride(-1) == 1


@functools.cache
def _kernels() -> ModuleType:
    from radixlm_runtime.layers import triton_elementwise

    return triton_elementwise


@functools.cache
def _matmul_kernels() -> ModuleType:
    from radixlm_runtime.layers import triton_matmul

    return triton_matmul


def _pow2(n: int) -> int:
    """The smallest power of two >= n: Triton blocks are powers of two, the tails masked."""
    return 1 << max(n - 1, 0).bit_length()


def _num_warps(block: int) -> int:
    """About eight elements per thread, between one and eight warps."""
    return min(max(block // 256, 1), 8)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """weight * rms_norm(x + residual) for x [T, H]; residual becomes x + residual in place. The
    output has the dtype torch promotes weight and the stream (residual if given, else x) to."""
    rows, hidden = x.shape
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError("residual must have x's shape and rows of contiguous elements")
    stream = x if residual is None else residual
    out = torch.empty(rows, hidden, dtype=torch.promote_types(weight.dtype, stream.dtype), device=x.device)
    if rows == 0:
        return out
    block = _pow2(hidden)
    _kernels()._rms_norm_kernel[(rows,)](
        x,
        stream,
        weight,
        out,
        x.stride(0),
        stream.stride(0),
        out.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotates the first `heads` heads of each row of x [T, W] in place; cos, sin [T, head_dim / 2]."""
    rows = x.shape[0]
    half = head_dim // 2
    if (
        cos.shape != (rows, half)
        or sin.shape != cos.shape
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        raise ValueError(f"cos/sin must be contiguous [{rows}, {half}], got {tuple(cos.shape)}")
    if heads * head_dim > x.shape[1]:
        raise ValueError(f"{heads} heads of {head_dim} do not fit rows of {x.shape[1]}")
    if rows == 0:
        return
    block_h, block_half = _pow2(heads), _pow2(half)
    _kernels()._rope_kernel[(rows,)](
        x,
        cos,
        sin,
        x.stride(0),
        cos.stride(0),
        heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=_num_warps(block_h * block_half * 2),
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I], gate first; the output [T, I] has gate_up's dtype."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(_pow2(inter), 1024)
    _kernels()._silu_and_mul_kernel[(rows, -(-inter // block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=_num_warps(block)
    )
    return out


def store_kv(
    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_buf[loc] = k and v_buf[loc] = v, cast to the buffers' dtype: k, v [n, H, D] (any token and
    head strides), buffers [S, H, D] of one layout, loc [n] slot ids."""
    n, heads, head_dim = k.shape
    if v.shape != k.shape or k_buf.shape[1:] != k.shape[1:] or k_buf.stride() != v_buf.stride():
        raise ValueError("k, v and the buffers must agree in heads, head_dim and layout")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_buf.stride(2) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    if n == 0:
        return
    block_h, block_d = _pow2(heads), _pow2(head_dim)
    _kernels()._store_kv_kernel[(n,)](
        k,
        v,
        k_buf,
        v_buf,
        loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        heads,
        head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=_num_warps(2 * block_h * block_d),
    )


# The matmul's one tile shape and K span, whatever the row count: what makes it batch-invariant.
INVARIANT_BLOCK_M, INVARIANT_BLOCK_N, INVARIANT_BLOCK_K = 32, 64, 32
INVARIANT_SPLIT_K = 256
# Below this many output tiles the spans of K run as programs of their own (the split pair): about
# the SMs of an H100, which a decode step's few tiles, each walking all of K, would leave idle.
INVARIANT_SPLIT_BELOW_TILES = 128


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, split: bool | None = None
) -> torch.Tensor:
    """x @ weight^T + bias for x [T, K] (rows of contiguous elements), weight [N, K] contiguous, in x's
    dtype, accumulated in float32 (float32 inputs multiply in full precision, not tf32). Each row's
    result is bit-identical whatever rows come with it: --deterministic's linears (cuBLAS picks its
    algorithm, and splits K, by the row count). K's spans are summed in one program per tile, or
    (`split`; by default below INVARIANT_SPLIT_BELOW_TILES tiles) in a program each and then added: the
    same operations in the same order, so the same bits (triton_matmul)."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or not weight.is_contiguous() or x.stride(-1) != 1:
        raise ValueError(f"x [{rows}, {k}] (contiguous rows) needs a contiguous weight [N, {k}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype of {_DTYPES}, got {x.dtype} and {weight.dtype}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    from radixlm_runtime.kernels.triton_dot import dot_dtype  # loads Triton: only where a kernel runs

    kernels = _matmul_kernels()
    tiles = (-(-rows // INVARIANT_BLOCK_M), -(-n // INVARIANT_BLOCK_N))
    spans = -(-k // INVARIANT_SPLIT_K)
    if split is None:
        split = spans > 1 and tiles[0] * tiles[1] < INVARIANT_SPLIT_BELOW_TILES
    blocks = {"BLOCK_M": INVARIANT_BLOCK_M, "BLOCK_N": INVARIANT_BLOCK_N}
    dot = {"DOT_DTYPE": dot_dtype(x.dtype, kernels._invariant_matmul_kernel), "BLOCK_K": INVARIANT_BLOCK_K}
    tile = {"SPLIT_K": INVARIANT_SPLIT_K, **blocks, **dot, "num_warps": 4}
    dims, strides = (rows, n, k), (x.stride(0), weight.stride(0))
    b, has_bias = (bias, True) if bias is not None else (weight, False)
    if not split:
        kernels._invariant_matmul_kernel[tiles](
            x, weight, b, out, *dims, *strides, out.stride(0), HAS_BIAS=has_bias, **tile
        )
        return out
    partial = torch.empty(spans, rows, n, dtype=torch.float32, device=x.device)
    kernels._invariant_span_kernel[(*tiles, spans)](x, weight, partial, *dims, *strides, **tile)
    kernels._invariant_sum_kernel[tiles](
        partial, b, out, rows, n, spans, out.stride(0), HAS_BIAS=has_bias, **blocks, num_warps=4
    )
    return out
