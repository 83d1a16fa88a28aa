"""Builds, loads and calls the weight-only quantized CPU matmul of quant_cpu.cpp.

The source is compiled once per machine with the system C++ compiler into a shared library cached under
~/.cache/radixlm/kernels (or $RADIXLM_KERNEL_CACHE_DIR), keyed by the source's hash, and called through
ctypes: no torch headers, so the build takes seconds, and ctypes releases the GIL during the call. The
library links the same OpenMP runtime (libgomp.so.1) torch already loaded, so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from radixlm_runtime.layers.quantization import QuantizedWeight
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

KERNEL_CACHE_ENV = "RADIXLM_KERNEL_CACHE_DIR"
_SOURCE = Path(__file__).with_name("quant_cpu.cpp")
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp")

# Kernel modes of rq_linear: the portable loop, the AVX2 row-dot kernel and the AVX2 panel GEMM.
SCALAR, ROW_DOT, PANEL_GEMM = 0, 1, 2
# From this many rows of x on, dequantising 16-row panels for a register-blocked GEMM beats reading
# the packed weights once per 4 rows (measured on AVX2 at the default model's shapes: even at 12).
PANEL_GEMM_MIN_ROWS = 12


class QuantKernelError(RuntimeError):
    """The quantized CPU kernels cannot be built or loaded on this machine."""


def _cache_dir() -> Path:
    env = os.environ.get(KERNEL_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "radixlm" / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise QuantKernelError(
        "quantized CPU linears need a C++ compiler (g++ or clang++) to build their kernels once; "
        "install one (e.g. `apt-get install g++`), or pass --quantization none"
    )


def _build(target: Path) -> None:
    compiler = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the quantized CPU kernels into %s (once per machine)", target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staged = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", str(staged)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise QuantKernelError(
                f"building {_SOURCE.name} with {compiler} failed:\n{result.stderr[-4000:]}"
            )
        # Atomic: a concurrent builder's identical library may already be there, either is fine.
        os.replace(staged, target)


@functools.cache
def _library() -> ctypes.CDLL:
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    path = _cache_dir() / f"quant_cpu-{digest}.so"
    if not path.is_file():
        _build(path)
    lib = ctypes.CDLL(str(path))
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
    if not has_avx2_fma():
        return SCALAR
    return PANEL_GEMM if rows >= PANEL_GEMM_MIN_ROWS else ROW_DOT


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, mode: int | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) for float32 x on the CPU; `mode` forces a kernel (tests reach every path)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"quantized CPU linears take float32 CPU activations, got {x.dtype} on {x.device}")
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight expects {k}")
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        _library().rq_linear(
            rows.data_ptr(),
            rows.shape[0],
            k,
            weight.qweight.data_ptr(),
            weight.scales.data_ptr(),
            None if weight.mins is None else weight.mins.data_ptr(),
            n,
            weight.group_size,
            weight.bits,
            out.data_ptr(),
            kernel_mode(rows.shape[0]) if mode is None else mode,
            torch.get_num_threads(),
        )
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)
