"""Constraint validation before a request is queued, on the configured grammar backend.

Checking parses the grammar without the tokenizer: milliseconds on llguidance and xgrammar, and
bounded by the libraries' own limits for exploding patterns. It runs on a worker thread (the
libraries release the GIL in native code), so the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from radixlm_runtime.constrained.backend import check_constraint, load_backend_module
from radixlm_runtime.constrained.constraint import Constraint

# Two threads bound the CPU that a burst of bad constraints can take from serving.
DEFAULT_WORKERS = 2
# Constraints already validated, remembered here so a repeated one skips the check.
MAX_REMEMBERED = 256


class ConstraintChecker:
    def __init__(self, backend: str, workers: int = DEFAULT_WORKERS) -> None:
        self.backend = backend
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="constraint-check")
        self._valid: OrderedDict[Constraint, None] = OrderedDict()

    async def check(self, constraint: Constraint) -> None:
        """Raises ValueError (its message starting with the field) for a constraint the engine
        would refuse."""
        if constraint in self._valid:
            self._valid.move_to_end(constraint)
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, check_constraint, self.backend, constraint)
        self._valid[constraint] = None
        if len(self._valid) > MAX_REMEMBERED:
            self._valid.popitem(last=False)

    def warm_up(self) -> None:
        """Imports the backend's library in the background, so the first constrained request does
        not wait for it."""
        self._pool.submit(load_backend_module, self.backend)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
