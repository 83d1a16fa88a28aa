"""What this CPU can run, asked of it rather than assumed: the SIMD level the C++ kernels are picked by,
and a one-line description of the CPU runtime (cores, threads, allocator, OpenMP runtime) logged at
start-up, so that a slow run on another machine can be explained from its log."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

# SIMD levels of the kernels, best first: each needs every flag listed.
_LEVELS = (
    ("avx512", frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"})),
    ("avx2", frozenset({"avx2", "fma"})),
)
SCALAR = "scalar"


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]
    logical_cores: int

    @classmethod
    def parse(cls, cpuinfo: str, logical_cores: int) -> CpuInfo:
        """From the text of /proc/cpuinfo (its first processor's model name and flags)."""
        model, flags = "unknown CPU", frozenset[str]()
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
        return cls(model, flags, logical_cores)

    @functools.cached_property
    def simd(self) -> str:
        """The best SIMD level the kernels have a path for on this CPU."""
        return next((name for name, needs in _LEVELS if needs <= self.flags), SCALAR)

    @property
    def bf16(self) -> bool:
        """bf16 dot products: AVX512-BF16 (the kernels' path; AMX-BF16 CPUs have it too)."""
        return self.simd == "avx512" and "avx512_bf16" in self.flags

    @property
    def vnni(self) -> bool:
        """int8 dot products on 512-bit vectors (AVX512-VNNI: the int8-activation kernels' path)."""
        return self.simd == "avx512" and "avx512_vnni" in self.flags

    def describe(self) -> str:
        extras = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in self.flags]
        return (
            f"{self.model}, {self.logical_cores} logical cores, kernels {self.simd}"
            f" (avx512: {'/'.join(extras) if extras else 'no'})"
        )


@functools.cache
def detect() -> CpuInfo:
    """This machine's CPU. Without /proc/cpuinfo (not Linux) no SIMD flags are known, so the kernels
    take their portable paths."""
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.is_file() else ""
    return CpuInfo.parse(text, os.cpu_count() or 1)


def runtime_environment(threads: int) -> str:
    """Threads, allocator and OpenMP runtime in effect: what the CPU speed of a run depends on beside
    the kernels. An allocator or OpenMP runtime preloaded by the launcher shows in LD_PRELOAD."""
    preload = [Path(p).name for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    allocator = next((p for p in preload if "malloc" in p), "glibc malloc")
    openmp = next((p for p in preload if "omp" in p), "libgomp (torch's)")
    return f"threads {threads}, allocator {allocator}, OpenMP {openmp}"
