"""Constraint validation in worker processes. Checking a pattern builds its character DFA: about a
second for a first generic JSON object, and the whole time budget for an exploding regex. In a
thread of the HTTP process that work holds the GIL and stalls every other request and /health, so
it runs in a small pool of low-priority processes, started in the background with the server."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from radixlm_runtime.constrained import validate_constraint

# Exploding patterns are refused at the time budget; two workers bound the CPU that a burst of
# them can take from the serving processes.
DEFAULT_WORKERS = 2
# Workers run at a lower priority, so the HTTP and scheduler processes win the CPU meanwhile.
WORKER_NICENESS = 10
# Constraints already validated, remembered here so a repeated one skips the round trip.
MAX_REMEMBERED = 256


def _lower_priority() -> None:
    os.nice(WORKER_NICENESS)


class ConstraintChecker:
    def __init__(self, workers: int = DEFAULT_WORKERS) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._valid: OrderedDict[tuple[str | None, str | None], None] = OrderedDict()

    async def check(self, regex: str | None, json_schema: str | None) -> None:
        """Raises ValueError (its message starting with the field) for a constraint the engine
        would refuse."""
        key = (regex, json_schema)
        if key in self._valid:
            self._valid.move_to_end(key)
            return
        await self._in_pool(regex, json_schema)
        self._valid[key] = None
        if len(self._valid) > MAX_REMEMBERED:
            self._valid.popitem(last=False)

    def warm_up(self) -> None:
        """Starts the workers now, in the background: a spawned worker takes over a second to import
        the checker, which the first constrained request would otherwise wait for."""
        pool = self._get_pool()
        for _ in range(self.workers):
            pool.submit(validate_constraint, "a", None)

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=mp.get_context("spawn"), initializer=_lower_priority
            )
        return self._pool

    async def _in_pool(self, regex: str | None, json_schema: str | None) -> None:
        pool = self._get_pool()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(pool, validate_constraint, regex, json_schema)
        except BrokenProcessPool:
            # A worker died (e.g. killed for memory) on this pattern: refuse it, start afresh.
            self.shutdown(wait=False)
            field = "regex" if regex is not None else "json_schema"
            raise ValueError(f"{field}: could not be checked (its checker process died)") from None

    def shutdown(self, wait: bool = True) -> None:
        """Waits (at most one validation's time budget) for the workers unless told not to."""
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None
