"""Lifetime of the processes radixlm starts (tensor-parallel ranks, data-parallel replicas)."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import time
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Characters of a server's log quoted when it fails to start.
LOG_TAIL_CHARS = 4000


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends `sig` to this process when the thread that started it exits, however
    the parent dies (kill -9 included), so no child outlives its supervisor. Elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path | None = None, what: str = "server"
) -> None:
    """Returns once `url`/health answers 200: how every launcher here (the language's Runtime, the
    router's replicas, the benchmarks, the tests) waits for a server it started. Raises RuntimeError
    when `proc` exits first and TimeoutError after `timeout_s`, with the tail of `log_path` if given."""

    def tail() -> str:
        if log_path is None:
            return ""
        with open(log_path, errors="replace") as f:
            return f"; log {log_path}:\n" + f.read()[-LOG_TAIL_CHARS:]

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} at {url} exited with code {proc.returncode} while starting{tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} at {url} not healthy after {timeout_s:.0f}s{tail()}")
        time.sleep(0.2)
