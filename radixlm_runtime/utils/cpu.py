"""What this CPU can run, asked of it rather than assumed: the SIMD level the C++ kernels are picked by,
a one-line description of the CPU runtime (cores, threads, allocator, OpenMP runtime) logged at
start-up, so that a slow run on another machine can be explained from its log, and the thread count
that the cores other processes leave free can carry (ThreadGovernor)."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
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

    def describe(self) -> str:
        wanted = ("avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
        extras = [f for f in wanted if f in self.flags]
        return (
            f"{self.model}, {self.logical_cores} logical cores, kernels {self.simd}"
            f" (extensions: {'/'.join(extras) if extras else 'none'})"
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


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds since boot: busy on all cores together, this process's share of them, and the time
    this process's threads waited runnable for a core (the scheduler's run-queue delay)."""

    busy: float
    own: float
    waiting: float


def read_cpu_times() -> CpuTimes:
    """From /proc/stat's first line (user nice system idle iowait irq softirq steal, in clock ticks),
    this process's own user + system time (every thread's) and each thread's schedstat (ns on a core,
    ns waiting for one, timeslices)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(v) for v in fields[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    own = os.times()
    waiting = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            waiting += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile, or a kernel without schedstats
    return CpuTimes(busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, waiting / 1e9)


class ThreadGovernor:
    """The kernel thread count for the next step, from the cores other processes keep busy.

    A kernel's threads meet at a barrier after every parallel loop: with a core shared with a busy
    neighbour, its thread gets half that core, and every barrier waits for it (often for a whole
    scheduler time slice while it is descheduled), so two threads on two cores with one taken ran 2.8x
    slower than idle where one thread would run 2x. Every `interval_s` the governor reads the cores'
    worth of demand others put on the machine: their CPU time, plus the time our threads waited for a
    core (while a neighbour shares a core with one of ours it gets only part of it, and the rest shows
    as our wait). It gives back a core from 0.75 of one held on (so a light neighbour such as our own
    HTTP process costs nothing) and takes it again once others' demand drops below 0.25; a change
    needs two readings that agree, so a blip moves nothing."""

    def __init__(
        self,
        max_threads: int,
        interval_s: float = 0.5,
        read: Callable[[], CpuTimes] = read_cpu_times,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self.others = 0.0  # cores' worth of demand from other processes at the last reading
        self._interval, self._read, self._clock = interval_s, read, clock
        self._last = (clock(), read())
        self._pending: int | None = None

    def update(self) -> int:
        """The thread count to run the next step with (cheap between readings)."""
        now = self._clock()
        then, before = self._last
        if now - then < self._interval:
            return self.threads
        times = self._read()
        self._last = (now, times)
        others = (times.busy - before.busy) - (times.own - before.own) + (times.waiting - before.waiting)
        self.others = max(0.0, others / (now - then))
        target = self._target(self.others)
        if target == self.threads:
            self._pending = None
        elif target == self._pending:
            self.threads, self._pending = target, None
        else:
            self._pending = target
        return self.threads

    def _target(self, others: float) -> int:
        """Threads for `others` cores of demand: one fewer per core held from 0.75 on, one more per core
        released below 0.25; in between the current count stays (hysteresis)."""
        held = int(others + 0.25)
        free = int(others + 0.75)
        lo, hi = self.max_threads - free, self.max_threads - held
        return max(1, min(max(self.threads, lo), hi))
