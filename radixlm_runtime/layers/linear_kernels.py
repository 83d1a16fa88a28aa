"""Loads and calls the CPU matmul of linear_cpu.cpp (built by kernels/native.py): float32 or bf16 weights
in its panel layouts, weight-only quantized int8/int4, and int8 weights in row panels for decode's few
rows."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from radixlm_runtime.kernels.native import KernelBuildError, load_library
from radixlm_runtime.layers.quantization import CHUNK, QuantizedWeight
from radixlm_runtime.utils import cpu

_SOURCE = Path(__file__).with_name("linear_cpu.cpp")

# Kernel modes of rq_linear: the portable loop, the AVX2 row-dot kernel, the AVX2 panel GEMM, the
# AVX-512 row-dot kernel, the bf16 panel GEMM (AVX512-BF16), and for Act8Panels the 256-bit VNNI code on
# AVX512-VL (the AVX-VNNI path's arithmetic, for tests on CPUs without AVX-VNNI).
SCALAR, ROW_DOT, PANEL_GEMM, ROW_DOT_512, BF16_GEMM, VNNI_256 = 0, 1, 2, 3, 4, 5
# A bit OR'd into a mode: bf16 kept off AMX tiles, on the AVX512-BF16 kernel (benchmarks and tests set the
# two side by side).
NO_AMX = 8
# What rq_act8_path reports: the int8-activation kernel a mode runs on this CPU.
ACT8_PATHS = ("scalar", "AVX2", "AVX-VNNI", "AVX512-VL VNNI", "AVX512-VNNI")
# The CPU features rq_act8_path reads, as its bits (linear_cpu.cpp kFeat*), by /proc/cpuinfo flags.
_ACT8_FEATURES = (
    (1, ("avx2", "fma")),
    (2, ("avx2", "fma", "avx_vnni")),
    (4, ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
)
# What rq_bf16_path reports: the bf16 kernel a row count runs on this CPU.
BF16_PATHS = ("scalar", "AVX512-BF16", "AMX-BF16")
# The CPU features rq_bf16_path reads, as its bits (linear_cpu.cpp kFeatBf16, kFeatAmxBf16).
_BF16_FEATURES = ((1, ("avx512f", "avx512_bf16")), (2, ("amx_tile", "amx_bf16")))
# The arithmetic of the CPU matmuls (EngineConfig.dtype on CPU): float32 FMAs, or bf16 dot products with
# float32 accumulation.
FP32, BF16 = "float32", "bfloat16"
# From this many rows of x on, dequantising 16-row panels for a register-blocked GEMM beats reading
# the packed weights once per 4 rows (the row-dot kernels' blocks: 9 rows take three passes), for
# QuantizedWeight's GGUF layout (bf16 arithmetic, weights in another column order; float32 arithmetic
# reads QuantPanels, one kernel's bits at every row count). Measured
# on the Zen 4 at the default model's int4 shapes, all linears of 30 layers: 9 rows 16.1 ms on panels
# against 19.4 (AVX-512 row dots), 8 rows 16.3 against 15.8.
PANEL_GEMM_MIN_ROWS = 9


# Output rows per panel of the float32 layout.
PANEL = 16


class LinearKernelError(RuntimeError):
    """The CPU linear kernels cannot be built or loaded on this machine."""


def _panels(rows: torch.Tensor, dtype: torch.dtype, lead: int = 1) -> torch.Tensor:
    """rows [N, *rest] in panels of PANEL rows, the layout every panel kernel reads: N padded with zero
    rows to a multiple of PANEL, and each panel's rows moved behind its first `lead` other dimensions,
    [ceil(N / PANEL), *rest[:lead], PANEL, *rest[lead:]], in `dtype` (cast on the copy)."""
    n = rows.shape[0]
    padded = rows.new_zeros((-(-n // PANEL) * PANEL, *rows.shape[1:]), dtype=dtype)
    padded[:n] = rows
    return padded.view(-1, PANEL, *rows.shape[1:]).movedim(1, 1 + lead).contiguous()


@dataclass
class FloatPanels:
    """A float32 [out_features, in_features] weight as linear_cpu.cpp's panels: [ceil(N / 16), K, 16],
    16 output rows side by side per input column (rows past N are zero)."""

    panels: torch.Tensor
    out_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> FloatPanels:
        return cls(_panels(weight.detach(), torch.float32), weight.shape[0])

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]

    @functools.cached_property
    def kernel_args(self) -> tuple[int | None, ...]:
        """rq_linear's weight arguments, as QuantizedWeight.kernel_args: no scales or mins, bits 32."""
        return (self.panels.data_ptr(), None, None, self.out_features, self.in_features, 32)

    def dequantize(self) -> torch.Tensor:
        """The [N, K] weight back (the tests' reference)."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]


@dataclass
class BF16Panels:
    """A weight as bf16 pair panels for the bf16 GEMM: [ceil(N / 16), K / 2, 16, 2], 16 output rows side
    by side per pair of input columns (rows past N are zero), rounded to nearest even. K must be even."""

    panels: torch.Tensor
    out_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> BF16Panels:
        n, k = weight.shape
        if k % 2:
            raise ValueError(f"bf16 pair panels need an even in_features, got {k}")
        return cls(_panels(weight.detach().view(n, k // 2, 2), torch.bfloat16), n)

    @property
    def in_features(self) -> int:
        return self.panels.shape[1] * 2

    @functools.cached_property
    def kernel_args(self) -> tuple[int | None, ...]:
        """rq_linear's weight arguments: no scales or mins, bits 16."""
        return (self.panels.data_ptr(), None, None, self.out_features, self.in_features, 16)

    def dequantize(self) -> torch.Tensor:
        """The [N, K] bf16 weight as float32 (the tests' reference)."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].float()


def bf16_available() -> bool:
    """Whether this CPU has bf16 dot products (AVX512-BF16; AMX-BF16 CPUs have them too), asked of the
    CPU (utils/cpu.py, which tests fake) and of the built kernels."""
    if not cpu.detect().bf16:
        return False
    try:
        return bool(_library().rq_has_avx512_bf16())
    except LinearKernelError:
        return False


def panels_available() -> bool:
    """Whether float32 linears run on the panel kernels here: a SIMD path for this CPU (elsewhere, e.g.
    on ARM, oneDNN's GEMM is the faster fallback) and a compiler to build them."""
    if cpu.detect().simd == cpu.SCALAR:
        return False
    try:
        _library()
    except LinearKernelError:
        return False
    return True


@functools.cache
def _library() -> ctypes.CDLL:
    try:
        lib = load_library(_SOURCE)
    except KernelBuildError as e:
        raise LinearKernelError(f"{e}; or pass --quantization none") from e
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
    lib.rq_has_avx512_vnni.restype = ctypes.c_int
    lib.rq_has_avx512_bf16.restype = ctypes.c_int
    lib.rq_act8_path.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.rq_act8_path.restype = ctypes.c_int
    lib.rq_bf16_path.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.rq_bf16_path.restype = ctypes.c_int
    lib.rq_panel8_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.rq_panel8_linear.restype = None
    return lib


def load_kernels() -> None:
    """Builds (once) and loads the kernels now, so a missing compiler fails at start-up, not mid-request."""
    _library()


@functools.cache
def has_avx2_fma() -> bool:
    """Whether this CPU runs the vectorised kernels (asked of the CPU, not assumed)."""
    return bool(_library().rq_has_avx2_fma())


def kernel_mode(rows: int, compute: str = FP32) -> int:
    """The kernel rq_linear runs for `rows` rows of activations on this CPU: for quantized weights the
    row-dot kernels below PANEL_GEMM_MIN_ROWS rows and a panel GEMM from there, in bf16 under that
    compute. Float weights have one kernel per layout whatever the mode but SCALAR."""
    simd = cpu.detect().simd
    if simd == cpu.SCALAR:
        return SCALAR
    if rows >= PANEL_GEMM_MIN_ROWS:
        return BF16_GEMM if compute == BF16 else PANEL_GEMM
    return ROW_DOT_512 if simd == "avx512" else ROW_DOT


def cpu_linear(
    x: torch.Tensor,
    weight: QuantizedWeight | FloatPanels | BF16Panels | Act8Panels | QuantPanels,
    bias: torch.Tensor | None = None,
    mode: int | None = None,
    compute: str = FP32,
) -> torch.Tensor:
    """x @ weight.T (+ bias) for float32 x on the CPU, in `compute` arithmetic; `mode` forces a kernel
    (tests reach every path)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"the CPU linear kernels take float32 CPU activations, got {x.dtype} on {x.device}")
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
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
            kernel_mode(m, compute) if mode is None else mode,
            torch.get_num_threads(),
        )
    if bias is not None:
        out += bias
    return out if flat else out.view(*x.shape[:-1], n)


@dataclass
class Int8Panels:
    """An int8 weight without mins (GGUF Q8_0) as rq_panel8_linear's row panels: codes
    [ceil(N / 16), K / 2, 16, 2] (16 output rows side by side per pair of input columns, rows past N
    zero) and one scale per row and 32 columns, [ceil(N / 16), K / 32, 16]. Decode's few rows multiply
    them with integer dot products at the memory's speed, where widening every code to a float
    (cpu_linear's row-dot kernel) takes twice the time; the numbers are the weight's own (see
    linear_cpu.cpp, "int8 row panels")."""

    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int

    @staticmethod
    def fits(weight: QuantizedWeight) -> bool:
        """Whether weight has this layout's numbers: int8 codes times a scale per whole 32 columns."""
        return (
            weight.bits == 8
            and weight.mins is None
            and weight.input_order is None
            and weight.group_size % CHUNK == 0
        )

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> Int8Panels:
        if not cls.fits(weight):
            raise ValueError("row panels hold int8 weights without mins or input order, in groups of 32k")
        n, k = weight.out_features, weight.in_features
        scales = weight.scales.repeat_interleave(weight.group_size // CHUNK, dim=1)
        return cls(
            _panels(weight.qweight.view(n, k // 2, 2), torch.int8),
            _panels(scales, torch.float32),
            n,
        )

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 2


# rq_linear's bits flag of QuantPanels (linear_cpu.cpp's kQuantPanels).
QUANT_PANELS_BITS = 0x200
# Its bit for float16 scales and mins (kQuantPanelsHalf).
QUANT_PANELS_HALF_BITS = 0x400


@dataclass
class QuantPanels:
    """An int4/int8 weight repacked k-major for float activations (linear_cpu.cpp, "quantized panels"):
    codes per 16 output rows side by side per input column, int4 [ceil(N / 16), K / 2, 16] (a byte: the
    row's code of column 2i in its low nibble, of 2i + 1 in its high one), int8 [ceil(N / 16), K, 16];
    scales and mins [ceil(N / 16), K / group, 16] (mins None for symmetric weights; rows past N zero),
    float16 where every value is one exactly (GGUF blocks store them so: a decode step then reads a
    sixth fewer bytes of an int4 weight), else float32. The kernel dequantizes in registers for up to 8
    rows at once, and every row count gets the same bits: the float32 panels' arithmetic on the
    dequantized weight."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    out_features: int

    @staticmethod
    def fits(weight: QuantizedWeight) -> bool:
        """Whether weight has this layout's numbers: columns in order (any of QuantizedWeight's groups)."""
        return weight.input_order is None

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> QuantPanels:
        if not cls.fits(weight):
            raise ValueError("quantized panels hold weights in column order")
        codes = weight.codes()
        if weight.bits == 4:
            codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        scales = _panels(weight.scales, torch.float32)
        mins = None if weight.mins is None else _panels(weight.mins, torch.float32)
        if all(t is None or torch.equal(t.half().float(), t) for t in (scales, mins)):
            scales, mins = scales.half(), None if mins is None else mins.half()
        return cls(
            _panels(codes, torch.uint8 if weight.bits == 4 else torch.int8),
            scales,
            mins,
            weight.bits,
            weight.group_size,
            weight.out_features,
        )

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * self.group_size

    @functools.cached_property
    def kernel_args(self) -> tuple[int | None, ...]:
        """rq_linear's weight arguments: codes, scales, mins, N, group, bits | QUANT_PANELS_BITS (|
        QUANT_PANELS_HALF_BITS for float16 scales)."""
        mins = None if self.mins is None else self.mins.data_ptr()
        ptrs = (self.codes.data_ptr(), self.scales.data_ptr(), mins)
        half = QUANT_PANELS_HALF_BITS if self.scales.dtype == torch.float16 else 0
        return (*ptrs, self.out_features, self.group_size, self.bits | QUANT_PANELS_BITS | half)


# rq_linear's bits flag of Act8Panels (linear_cpu.cpp's kAct8).
ACT8_BITS = 0x100


@dataclass
class Act8Panels:
    """An int4/int8 weight repacked for int8 activations (linear_cpu.cpp, "int8 activations"): u8 codes
    [ceil(N / 16), K / 32, V, 16, 4] (V = 4 vectors of GGUF nibble bytes for int4, 8 of code + 128 for
    int8; rows past N zero) and float32 scales and mins [ceil(N / 16), K / 32, 16] (mins None where
    the weight has none: the kernels then skip their term). Every row count runs one kernel on it."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    out_features: int

    @staticmethod
    def fits(weight: QuantizedWeight) -> bool:
        """Whether weight has this layout's numbers: a scale (and min) per whole 32 columns, columns in
        order."""
        return weight.input_order is None and weight.group_size % CHUNK == 0

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> Act8Panels:
        if not cls.fits(weight):
            raise ValueError("int8-activation panels hold weights in column order, in groups of 32k")
        n, chunks = weight.out_features, weight.in_features // CHUNK
        if weight.bits == 4:
            codes = weight.qweight.view(n, chunks, 4, 4)  # (chunk, vector h, byte): GGUF's own bytes
        else:
            codes = (weight.qweight.to(torch.int16) + 128).to(torch.uint8).view(n, chunks, 8, 4)
        per_chunk = weight.group_size // CHUNK
        scales = weight.scales.repeat_interleave(per_chunk, dim=1)
        mins = None if weight.mins is None else weight.mins.repeat_interleave(per_chunk, dim=1)
        return cls(
            _panels(codes, torch.uint8, lead=2),
            _panels(scales, torch.float32),
            None if mins is None else _panels(mins, torch.float32),
            weight.bits,
            n,
        )

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * CHUNK

    @functools.cached_property
    def kernel_args(self) -> tuple[int | None, ...]:
        """rq_linear's weight arguments: codes, scales, mins, N, group 32, bits | ACT8_BITS."""
        mins = None if self.mins is None else self.mins.data_ptr()
        ptrs = (self.codes.data_ptr(), self.scales.data_ptr(), mins)
        return (*ptrs, self.out_features, CHUNK, self.bits | ACT8_BITS)


def act8_available() -> bool:
    """Whether int8 activations run a SIMD path here: AVX512-VNNI, AVX-VNNI or AVX2's byte products, on
    any CPU with the AVX2 kernels (asked of the CPU: faked CPU features in tests)."""
    return panels_available()


def act8_path(rows: int = 1, cpu_info: cpu.CpuInfo | None = None) -> str:
    """The int8-activation kernel `rows` rows run (for the log): on this CPU as the built library sees
    it, or on `cpu_info`'s features (tests fake them)."""
    features = -1
    if cpu_info is not None:
        features = sum(bit for bit, flags in _ACT8_FEATURES if set(flags) <= cpu_info.flags)
    return ACT8_PATHS[_library().rq_act8_path(kernel_mode(rows), rows, features)]


def bf16_path(rows: int, in_features: int, cpu_info: cpu.CpuInfo | None = None) -> str:
    """The bf16 kernel `rows` rows of `in_features` columns run (for the log): on this CPU as the built
    library sees it (AMX-BF16 only once it has checked itself here), or on `cpu_info`'s features (tests
    fake them)."""
    features = -1
    if cpu_info is not None:
        features = sum(bit for bit, flags in _BF16_FEATURES if set(flags) <= cpu_info.flags)
    return BF16_PATHS[_library().rq_bf16_path(BF16_GEMM, rows, in_features, features)]


def int8_panels_available() -> bool:
    """Whether row panels run their SIMD path here (AVX-512 VNNI, asked of the CPU); elsewhere the
    row-dot kernel is the faster one."""
    try:
        return bool(_library().rq_has_avx512_vnni())
    except LinearKernelError:
        return False


def int8_panel_linear(x: torch.Tensor, weight: Int8Panels, mode: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T for float32 CPU x; `mode` SCALAR forces the portable loop (tests)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"row panels take 2-D float32 CPU rows, got {x.dtype} {tuple(x.shape)}, {x.device}")
    if x.shape[1] != weight.in_features:
        raise ValueError(f"input has {x.shape[1]} features, the weight expects {weight.in_features}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    if x.shape[0]:
        _library().rq_panel8_linear(
            x.data_ptr(),
            x.shape[0],
            weight.in_features,
            weight.codes.data_ptr(),
            weight.scales.data_ptr(),
            weight.out_features,
            out.data_ptr(),
            ROW_DOT_512 if mode is None else mode,
            torch.get_num_threads(),
        )
    return out
