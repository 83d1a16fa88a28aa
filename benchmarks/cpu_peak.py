"""This machine's measured peak arithmetic rate per vector instruction set and thread count, through
cpu_peak.cpp (built once by radixlm_runtime/kernels/native.py's load_library): the ceiling
bench_linear_cpu.py reports the linear kernels against.

A path's rate is ops per instruction (a multiply-add counts two: fp32 FMA 2 x lanes, vdpbf16ps 2 x 2
per float lane, vpdpbusd 2 x 4 per int32 lane; AVX2's three-instruction int8 step as one vpdpbusd
ymm; an AMX tile product 2 x 16 x 16 x 64 bytes or x 32 bf16) times the instructions its chains
retired, over the wall time of the parallel region; best of `repeats` runs of about `seconds` each. A
path this CPU lacks is left out (`supported` says which).

A second measurement (`--mixes`, and `vnni_slots`) asks what each instruction the int8-activation
kernels run beside their `vpdpbusd` costs it: one thread, 16 `vpdpbusd` zmm chains and 4 of that
instruction a round, its cost the round's extra time in `vpdpbusd` slots (1: it takes a slot, as on
a port both run on; 0: it runs beside them for free). That, not the loop's length, is what bounds those
kernels below the `vpdpbusd` peak (benchmarks/README.md, "CPU arithmetic").

    python benchmarks/cpu_peak.py                # every path at all cores and at 1 thread
    python benchmarks/cpu_peak.py --threads 1,2
    python benchmarks/cpu_peak.py --mixes        # and the vpdpbusd slots each companion instruction takes
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from radixlm_runtime.kernels.native import load_library

_SOURCE = Path(__file__).with_name("cpu_peak.cpp")


@dataclass(frozen=True)
class PeakPath:
    """One instruction path of cpu_peak.cpp: its number there, what it counts and its ops per
    instruction."""

    isa: int
    name: str
    instruction: str
    unit: str  # GFLOP/s or GOP/s
    ops_per_instruction: int


PATHS = {
    "fp32_fma_ymm": PeakPath(0, "fp32_fma_ymm", "vfmadd231ps ymm (AVX2)", "GFLOP/s", 16),
    "fp32_fma_zmm": PeakPath(1, "fp32_fma_zmm", "vfmadd231ps zmm (AVX-512)", "GFLOP/s", 32),
    "bf16_dot_zmm": PeakPath(2, "bf16_dot_zmm", "vdpbf16ps zmm (AVX512-BF16)", "GFLOP/s", 64),
    "int8_vnni_zmm": PeakPath(3, "int8_vnni_zmm", "vpdpbusd zmm (AVX512-VNNI)", "GOP/s", 128),
    "int8_vnni_ymm": PeakPath(4, "int8_vnni_ymm", "vpdpbusd ymm (AVX-VNNI)", "GOP/s", 64),
    "int8_avx2_ymm": PeakPath(5, "int8_avx2_ymm", "vpmaddubsw+vpmaddwd+vpaddd ymm (AVX2)", "GOP/s", 64),
    "int8_amx": PeakPath(6, "int8_amx", "tdpbusd (AMX-INT8)", "GOP/s", 2 * 16 * 16 * 64),
    "bf16_amx": PeakPath(7, "bf16_amx", "tdpbf16ps (AMX-BF16)", "GFLOP/s", 2 * 16 * 16 * 32),
}


# The companion instructions of cpu_peak_mix, by its numbering (0 is vpdpbusd alone).
MIXES = {
    "vmulps": 1,
    "vfmadd231ps": 2,
    "vaddps": 3,
    "vcvtdq2ps": 4,
    "vpaddd": 5,
    "vpandd": 6,
    "vpsrlw": 7,
    "vpbroadcastd (load)": 8,
    "vpshufd": 9,
    "vbroadcasti32x4 (load)": 10,
}
MIX_CHAINS, MIX_OPS = 16, 4  # vpdpbusd chains and companion instructions a round


@functools.cache
def _library() -> ctypes.CDLL:
    lib = load_library(_SOURCE)
    lib.cpu_peak_supported.argtypes = [ctypes.c_int]
    lib.cpu_peak_supported.restype = ctypes.c_int
    lib.cpu_peak_chains.argtypes = [ctypes.c_int]
    lib.cpu_peak_chains.restype = ctypes.c_int
    lib.cpu_peak_run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_int)]
    lib.cpu_peak_run.restype = ctypes.c_double
    lib.cpu_peak_mix.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.cpu_peak_mix.restype = ctypes.c_double
    return lib


def _iterations(run: Callable[[int], float], start: int, seconds: float) -> int:
    """Rounds for one timed run of about `seconds`: `run(n)` (wall seconds of n rounds) grown from
    `start` until it is long enough that start-up and timer noise vanish, then scaled."""
    iters = start
    while (elapsed := run(iters)) < seconds / 4:
        iters *= 4
    return max(1, int(iters * seconds / elapsed))


def supported() -> dict[str, bool]:
    """Which paths this CPU runs (asked of the CPU by the library)."""
    lib = _library()
    return {name: bool(lib.cpu_peak_supported(p.isa)) for name, p in PATHS.items()}


def measure(name: str, threads: int, seconds: float = 0.2, repeats: int = 5) -> float | None:
    """Peak G(FL)OP/s of path `name` on `threads` threads, best of `repeats`; None where this CPU lacks
    the path."""
    lib, path = _library(), PATHS[name]
    if not lib.cpu_peak_supported(path.isa):
        return None
    team = ctypes.c_int(0)
    run = functools.partial(lib.cpu_peak_run, path.isa, threads)
    iters = _iterations(lambda n: run(n, ctypes.byref(team)), 1 << 16, seconds)
    best = 0.0
    for _ in range(repeats):
        elapsed = lib.cpu_peak_run(path.isa, threads, iters, ctypes.byref(team))
        ops = team.value * iters * lib.cpu_peak_chains(path.isa) * path.ops_per_instruction
        best = max(best, ops / elapsed / 1e9)
    return best


def peaks(threads: int, seconds: float = 0.2, repeats: int = 5) -> dict[str, float]:
    """Every path this CPU runs, measured on `threads` threads: name -> G(FL)OP/s."""
    found = {name: measure(name, threads, seconds, repeats) for name in PATHS}
    return {name: rate for name, rate in found.items() if rate is not None}


def _mix_round_seconds(op: int, seconds: float, repeats: int) -> float:
    """Best seconds per round of cpu_peak_mix's kind `op` (calibrated as `measure`)."""
    lib = _library()
    iters = _iterations(lambda n: lib.cpu_peak_mix(op, n), 1 << 14, seconds)
    return min(lib.cpu_peak_mix(op, iters) for _ in range(repeats)) / iters


def vnni_slots(seconds: float = 0.1, repeats: int = 5) -> dict[str, float] | None:
    """vpdpbusd zmm slots one instruction of each MIXES kind takes among them, on one thread; None
    where this CPU lacks AVX512-VNNI. Kinds are measured alternately with vpdpbusd alone, each against
    the alone round nearest in time, so a drifting clock moves both."""
    if not _library().cpu_peak_supported(PATHS["int8_vnni_zmm"].isa):
        return None
    slots = {}
    for name, op in MIXES.items():
        alone = _mix_round_seconds(0, seconds, repeats)
        mixed = _mix_round_seconds(op, seconds, repeats)
        slots[name] = (mixed - alone) / (alone / MIX_CHAINS) / MIX_OPS
    return slots


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = os.cpu_count() or 1
    ap.add_argument("--threads", default=f"{cores},1" if cores > 1 else "1", help="Comma-separated.")
    ap.add_argument("--seconds", type=float, default=0.2, help="Length of one timed run.")
    ap.add_argument(
        "--mixes", action="store_true", help="Also the vpdpbusd slots each companion instruction takes."
    )
    args = ap.parse_args(argv)
    have = supported()
    for threads in (int(t) for t in args.threads.split(",")):
        for name, path in PATHS.items():
            rate = measure(name, threads, args.seconds) if have[name] else None
            shown = f"{rate:9.1f} {path.unit}" if rate is not None else "  (this CPU lacks it)"
            print(f"{threads:3d} thread(s)  {path.instruction:30s} {shown}")
    if args.mixes:
        slots = vnni_slots(args.seconds / 2)
        if slots is None:
            print("vpdpbusd zmm slots: this CPU lacks AVX512-VNNI")
        for name, taken in (slots or {}).items():
            print(f"  one {name:20s} beside vpdpbusd zmm takes {taken:5.2f} of its slots")


if __name__ == "__main__":
    main()
