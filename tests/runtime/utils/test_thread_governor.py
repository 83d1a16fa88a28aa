"""The CPU kernels' thread count under a busy neighbour (utils/cpu.py ThreadGovernor): one thread fewer
per core other processes hold, back once they leave, steady against blips and light neighbours; fed
scripted CPU times and a scripted clock, and once from this machine's real /proc."""

from __future__ import annotations

import time

import pytest
import torch

from radixlm_runtime.executor.model_runner import ModelRunner
from radixlm_runtime.utils import cpu


class Machine:
    """Scripted CPU times: each reading advances the clock by one second, in which others take
    `others` cores, this process `own` and its threads wait `waiting`."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.waiting = 0.0, 0.0, 0.0, 0.0

    def clock(self) -> float:
        return self.now

    def read(self) -> cpu.CpuTimes:
        return cpu.CpuTimes(self.busy, self.own, self.waiting)

    def second(self, others: float, own: float = 2.0, waiting: float = 0.0) -> None:
        self.now += 1.0
        self.busy += others + own
        self.own += own
        self.waiting += waiting


def _governor(machine: Machine, threads: int = 2) -> cpu.ThreadGovernor:
    return cpu.ThreadGovernor(threads, interval_s=0.5, read=machine.read, clock=machine.clock)


def _run(governor: cpu.ThreadGovernor, machine: Machine, seconds: list[tuple[float, float]]) -> list[int]:
    """Thread counts after each scripted second of (others' CPU, our threads' run-queue wait)."""
    counts = []
    for others, waiting in seconds:
        machine.second(others, waiting=waiting)
        counts.append(governor.update())
    return counts


def test_a_neighbour_holding_a_core_takes_a_thread_until_it_leaves() -> None:
    machine = Machine()
    governor = _governor(machine)
    # Idle; then a busy loop shares a core with one of our threads (it gets half, our thread waits the
    # other half); with one thread left it has its core to itself; then it leaves.
    counts = _run(
        governor, machine, [(0.0, 0.0)] * 2 + [(0.5, 0.5)] * 2 + [(1.0, 0.0)] * 3 + [(0.0, 0.0)] * 2
    )
    # Each change waits for a second reading that agrees.
    assert counts == [2, 2, 2, 1, 1, 1, 1, 1, 2]
    assert governor.others == pytest.approx(0.0)


def test_blips_and_light_neighbours_move_nothing() -> None:
    machine = Machine()
    governor = _governor(machine)
    # One busy second between idle ones, then a neighbour at 0.4 of a core (our own HTTP process).
    assert _run(governor, machine, [(0.0, 0.0), (1.5, 0.0), (0.0, 0.0)] + [(0.4, 0.1)] * 4) == [2] * 7


def test_between_the_thresholds_the_count_stays() -> None:
    """0.5 of a core neither takes a thread from the full count nor gives one back to the reduced."""
    machine = Machine()
    governor = _governor(machine)
    assert _run(governor, machine, [(0.5, 0.0)] * 3) == [2, 2, 2]
    assert _run(governor, machine, [(1.0, 0.0)] * 2 + [(0.5, 0.0)] * 3) == [2, 1, 1, 1, 1]


def test_never_below_one_thread_and_readings_wait_for_the_interval() -> None:
    machine = Machine()
    governor = _governor(machine, threads=4)
    assert _run(governor, machine, [(2.0, 0.0)] * 2) == [4, 2]
    assert _run(governor, machine, [(8.0, 0.0)] * 2) == [2, 1]
    machine.busy += 100.0  # no time passed: no reading, whatever the counters say
    assert governor.update() == 1


def test_reads_this_machines_cpu_times() -> None:
    """The counters advance with work. Work is timed by this process's CPU clock: os.times counts
    clock ticks (10 ms), and a fixed loop of ~10 ms sometimes fell within one tick on a loaded machine."""
    before = cpu.read_cpu_times()
    start = time.process_time()
    while time.process_time() - start < 0.05:
        sum(i * i for i in range(10_000))
    after = cpu.read_cpu_times()
    assert after.busy >= before.busy > 0 and after.own > before.own > 0
    assert after.waiting >= before.waiting >= 0


def test_the_runner_sets_torch_threads_from_the_governor() -> None:
    machine = Machine()
    governor = _governor(machine)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _run(governor, machine, [(1.0, 0.0)] * 2)
        ModelRunner._govern_threads(governor)
        assert torch.get_num_threads() == 1
        _run(governor, machine, [(0.0, 0.0)] * 2)
        ModelRunner._govern_threads(governor)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
