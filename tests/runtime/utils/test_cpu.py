"""CPU feature detection: parsed from /proc/cpuinfo text, and a CPU without AVX2+FMA (a fake feature
set) makes every C++ kernel take its portable path, which still computes the same results."""

from __future__ import annotations

import pytest
import torch

from radixlm_runtime.layers import fused_cpu, linear_kernels
from radixlm_runtime.layers.quantization import quantize_int4
from radixlm_runtime.utils import cpu

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx {extra}
processor\t: 1
model name\t: ignored, the first processor names the CPU
"""


def fake(extra: str) -> cpu.CpuInfo:
    return cpu.CpuInfo.parse(CPUINFO.format(extra=extra), logical_cores=2)


def test_parse_and_levels() -> None:
    avx2 = fake("avx2 fma f16c")
    assert avx2.model == "AMD EPYC 7B13" and avx2.simd == "avx2"
    assert "kernels avx2" in avx2.describe() and "extensions: none" in avx2.describe()
    assert fake("avx2").simd == cpu.SCALAR  # AVX2 without FMA is not enough
    assert fake("avx2 fma avx512f avx512bw").simd == "avx2"  # no avx512vl: the AVX2 kernels
    wide = fake("avx2 fma avx512f avx512bw avx512vl")
    assert wide.simd == "avx512" and "kernels avx512 (extensions: avx512f)" in wide.describe()
    assert cpu.CpuInfo.parse("", 4).simd == cpu.SCALAR  # no /proc/cpuinfo: portable paths


def test_this_machine_is_detected() -> None:
    info = cpu.detect()
    assert info.logical_cores >= 1 and info.model


def test_a_cpu_without_avx2_takes_the_portable_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(3, 64), torch.randn(40, 64)
    weight = quantize_int4(w, 32)
    want_linear = linear_kernels.cpu_linear(x, weight, mode=linear_kernels.SCALAR)
    gate_up = torch.randn(3, 128)
    want_silu = fused_cpu.silu_and_mul(gate_up, mode=fused_cpu.SCALAR)

    monkeypatch.setattr(cpu, "detect", lambda: fake("sse4_2"))
    assert linear_kernels.kernel_mode(1) == linear_kernels.SCALAR
    assert linear_kernels.kernel_mode(64) == linear_kernels.SCALAR
    assert fused_cpu.default_mode() == fused_cpu.SCALAR
    # The default path is now the portable one: bit-identical to forcing it.
    assert torch.equal(linear_kernels.cpu_linear(x, weight), want_linear)
    assert torch.equal(fused_cpu.silu_and_mul(gate_up), want_silu)

    monkeypatch.setattr(cpu, "detect", lambda: fake("avx2 fma avx512f avx512bw avx512vl"))
    assert linear_kernels.kernel_mode(1) == linear_kernels.ROW_DOT_512
    assert fused_cpu.default_mode() == fused_cpu.SIMD
    monkeypatch.setattr(cpu, "detect", lambda: fake("avx2 fma"))
    assert linear_kernels.kernel_mode(1) == linear_kernels.ROW_DOT
    assert linear_kernels.kernel_mode(64) == linear_kernels.PANEL_GEMM
    assert fused_cpu.default_mode() == fused_cpu.SIMD


def test_runtime_environment_names_preloaded_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert cpu.runtime_environment(2) == "threads 2, allocator glibc malloc, OpenMP libgomp (torch's)"
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4:/opt/libiomp5.so")
    assert cpu.runtime_environment(1) == "threads 1, allocator libtcmalloc_minimal.so.4, OpenMP libiomp5.so"
