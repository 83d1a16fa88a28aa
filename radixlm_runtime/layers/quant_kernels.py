"""Loads and calls the weight-only quantized CPU matmul of quant_cpu.cpp (built by kernels/native.py)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from radixlm_runtime.kernels.native import KernelBuildError, load_library
from radixlm_runtime.layers.quantization import QuantizedWeight
from radixlm_runtime.utils import cpu

_SOURCE = Path(__file__).with_name("quant_cpu.cpp")

# Kernel modes of rq_linear: the portable loop, the AVX2 row-dot kernel, the AVX2 panel GEMM and the
# AVX-512 row-dot kernel.
SCALAR, ROW_DOT, PANEL_GEMM, ROW_DOT_512 = 0, 1, 2, 3
# From this many rows of x on, dequantising 16-row panels for a register-blocked GEMM beats reading
# the packed weights once per 4 rows (measured on AVX2 at the default model's shapes: even at 12).
PANEL_GEMM_MIN_ROWS = 12


class QuantKernelError(RuntimeError):
    """The quantized CPU kernels cannot be built or loaded on this machine."""


@functools.cache
def _library() -> ctypes.CDLL:
    try:
        lib = load_library(_SOURCE)
    except KernelBuildError as e:
        raise QuantKernelError(f"{e}; or pass --quantization none") from e
    lib.rq_has_avx2_fma.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rq_linear.argtypes = [
        ptr,
        i64,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        i64,
        ctypes.c_int,
        ptr,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.rq_linear.restype = None
    return lib


def load_kernels() -> None:
    """Builds (once) and loads the kernels now, so a missing compiler fails at start-up, not mid-request."""
    _library()


@functools.cache
def has_avx2_fma() -> bool:
    """Whether this CPU runs the vectorised kernels (asked of the CPU, not assumed)."""
    return bool(_library().rq_has_avx2_fma())


def kernel_mode(rows: int) -> int:
    """The kernel rq_linear runs for `rows` rows of activations on this CPU."""
    simd = cpu.detect().simd
    if simd == cpu.SCALAR:
        return SCALAR
    if rows >= PANEL_GEMM_MIN_ROWS:
        return PANEL_GEMM
    return ROW_DOT_512 if simd == "avx512" else ROW_DOT


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, mode: int | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) for float32 x on the CPU; `mode` forces a kernel (tests reach every path)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"quantized CPU linears take float32 CPU activations, got {x.dtype} on {x.device}")
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight expects {k}")
    # At decode these calls are a few microseconds each, 121 per step: skip the reshapes a 2-D
    # contiguous input does not need.
    flat = x.dim() == 2 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        _library().rq_linear(
            rows.data_ptr(),
            m,
            k,
            *weight.kernel_args,
            out.data_ptr(),
            kernel_mode(m) if mode is None else mode,
            torch.get_num_threads(),
        )
    if bias is not None:
        out += bias
    return out if flat else out.view(*x.shape[:-1], n)
