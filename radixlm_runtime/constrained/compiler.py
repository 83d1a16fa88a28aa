"""Compiling constraints off the scheduler's critical path, with an in-memory LRU of compiled grammars.

The backend itself (which indexes the vocabulary, ~0.5 s) is built on the first compile, on a worker
thread too, so neither the first constrained request nor unconstrained use stalls the step loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from radixlm_runtime.constrained.backend import GrammarBackend, Guide
from radixlm_runtime.constrained.constraint import Constraint

# Compiled grammars kept for repeated constraints (clients resend the same schema).
DEFAULT_MAX_ENTRIES = 256


class GrammarCompiler:
    """Compiles constraints for one vocabulary on a small thread pool (the backends release the GIL
    while compiling), so the scheduler keeps decoding other requests meanwhile."""

    def __init__(
        self,
        make_backend: Callable[[], GrammarBackend],
        max_workers: int = 2,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self.max_entries = max_entries
        self._entries: OrderedDict[Constraint, Any] = OrderedDict()
        self._inflight: dict[Constraint, Future[Any]] = {}
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def compile(self, constraint: Constraint, grammar: str | None = None) -> Any:
        """Cached synchronous compile; ValueError naming the constraint's field when it is refused.
        `grammar`: the constraint's grammar as the front end checked it (None: checked here)."""
        with self._lock:
            compiled = self._entries.get(constraint)
            if compiled is not None:
                self._entries.move_to_end(constraint)
                return compiled
        compiled = self.backend.compile(constraint, grammar)
        with self._lock:
            self._entries[constraint] = compiled
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return compiled

    def submit(self, constraint: Constraint, grammar: str | None = None) -> Future[Any]:
        """Compiles in the pool; concurrent submissions of one constraint share a single future."""
        with self._lock:
            future = self._inflight.get(constraint)
            if future is not None:
                return future
            future = self._pool.submit(self.compile, constraint, grammar)
            self._inflight[constraint] = future
        # Outside the lock: a future that is already done runs the callback right here.
        future.add_done_callback(lambda _f: self._forget(constraint))
        return future

    def guide(self, compiled: Any) -> Guide:
        return self.backend.guide(compiled)

    def _forget(self, constraint: Constraint) -> None:
        with self._lock:
            self._inflight.pop(constraint, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
