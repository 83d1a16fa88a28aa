"""Lifetime of the processes radixlm starts (tensor-parallel ranks, data-parallel replicas)."""

from __future__ import annotations

import contextlib
import ctypes
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends `sig` to this process when the thread that started it exits, however
    the parent dies (kill -9 included), so no child outlives its supervisor. Elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
