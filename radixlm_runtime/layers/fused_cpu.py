"""Bindings of fused_cpu.cpp: RMSNorm with the residual add, per-head q/k RMSNorm in place, rotary in
place, SiLU-and-mul and GELU(tanh)-and-mul, in one pass each for float32 CPU tensors. The layers call
them where `supports` says so and keep their torch code as the reference (and the path for other
devices and dtypes)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from radixlm_runtime.kernels.native import KernelBuildError, load_library
from radixlm_runtime.utils import cpu
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

_SOURCE = Path(__file__).with_name("fused_cpu.cpp")
# Kernel modes: the portable loop, or the AVX2+FMA path where the CPU has it.
SCALAR, SIMD = 0, 1
# rf_gated_act's activations.
SILU, GELU_TANH = 0, 1


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = load_library(_SOURCE)
    except KernelBuildError as e:
        logger.warning("fused CPU ops unavailable, the torch ops run instead: %s", e)
        return None
    i64, ptr, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.rf_has_avx2_fma.restype = c_int
    lib.rf_rms_norm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, f32, c_int, c_int]
    lib.rf_head_rms_norm.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, f32, c_int, c_int]
    lib.rf_rope.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, c_int, c_int]
    lib.rf_gated_act.argtypes = [ptr, ptr, i64, i64, c_int, c_int, c_int]
    for fn in (lib.rf_rms_norm, lib.rf_head_rms_norm, lib.rf_rope, lib.rf_gated_act):
        fn.restype = None
    return lib


def supports(x: torch.Tensor) -> bool:
    """Whether the fused ops serve x: float32 on the CPU, rows of contiguous elements, library built."""
    return (
        x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1 and _library() is not None
    )


def has_simd() -> bool:
    lib = _library()
    return lib is not None and bool(lib.rf_has_avx2_fma())


def default_mode() -> int:
    """The path this CPU runs: SIMD where it has AVX2+FMA (asked of the CPU, never assumed)."""
    return SCALAR if cpu.detect().simd == cpu.SCALAR else SIMD


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the fused CPU ops could not be built on this machine")
    return lib


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    mode: int | None = None,
) -> torch.Tensor:
    """weight * rms_norm(x + residual) for x [T, H]; residual (contiguous) becomes x + residual."""
    rows, hidden = x.shape
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError("residual must be a contiguous tensor of x's shape")
    out = torch.empty(rows, hidden, dtype=torch.float32)
    _lib().rf_rms_norm(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
        default_mode() if mode is None else mode,
        torch.get_num_threads(),
    )
    return out


def rope_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int, mode: int | None = None
) -> None:
    """Rotates the first `heads` heads of each row of x [T, W] in place; cos, sin [T, head_dim / 2]."""
    rows = x.shape[0]
    if cos.shape != (rows, head_dim // 2) or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos/sin must be contiguous [{rows}, {head_dim // 2}], got {tuple(cos.shape)}")
    if heads * head_dim > x.shape[1]:
        raise ValueError(f"{heads} heads of {head_dim} do not fit rows of {x.shape[1]}")
    _lib().rf_rope(
        x.data_ptr(),
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        rows,
        heads,
        head_dim,
        default_mode() if mode is None else mode,
        torch.get_num_threads(),
    )


def head_rms_norm_(
    x: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    mode: int | None = None,
) -> None:
    """RMSNorm in place over each head of x [T, W] (rows of contiguous elements): the first q_heads
    heads of head_dim with q_weight, the next kv_heads with k_weight (Qwen3's and Gemma 3's q/k norms
    on a fused projection's output)."""
    if (q_heads + kv_heads) * head_dim > x.shape[1] or x.stride(-1) != 1:
        raise ValueError(f"{q_heads + kv_heads} heads of {head_dim} do not fit rows of {x.shape[1]}")
    _lib().rf_head_rms_norm(
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        q_heads,
        kv_heads,
        head_dim,
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        eps,
        default_mode() if mode is None else mode,
        torch.get_num_threads(),
    )


def silu_and_mul(gate_up: torch.Tensor, mode: int | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I], gate first."""
    return gated_act(gate_up, SILU, mode)


def gelu_tanh_and_mul(gate_up: torch.Tensor, mode: int | None = None) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for gate_up [T, 2I], gate first (Gemma's GeGLU)."""
    return gated_act(gate_up, GELU_TANH, mode)


def gated_act(gate_up: torch.Tensor, act: int, mode: int | None = None) -> torch.Tensor:
    """act(gate) * up for gate_up [T, 2I] (contiguous), gate first; act SILU or GELU_TANH."""
    rows, width = gate_up.shape
    gate_up = gate_up.contiguous()
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    _lib().rf_gated_act(
        gate_up.data_ptr(),
        out.data_ptr(),
        rows,
        width // 2,
        act,
        default_mode() if mode is None else mode,
        torch.get_num_threads(),
    )
    return out
