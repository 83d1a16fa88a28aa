"""The front end's constraint check, before a request is queued: each new constraint is parsed and
checked once, on the configured grammar backend, and its checked grammar travels with the request to
the scheduler's compile (constrained/backend.py check_constraint), which skips the parse.

Checking parses the grammar without the tokenizer: milliseconds on llguidance and xgrammar, and
bounded by the libraries' own limits for exploding patterns. On the server it runs on a small pool
of its own (the libraries release the GIL in native code), which bounds the CPU a burst of bad
constraints can take from serving; the offline Engine checks inline.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from radixlm_runtime.constrained.backend import check_constraint, load_backend_module
from radixlm_runtime.constrained.constraint import Constraint

# Checked grammars remembered, so a repeated constraint (clients resend the same schema) is not
# parsed again.
MAX_REMEMBERED = 256


class GrammarChecker:
    def __init__(self, backend: str, workers: int = 0) -> None:
        """workers: threads the checks run on (0: the caller's thread)."""
        self.backend = backend
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="constraint-check") if workers else None
        self._grammars: OrderedDict[Constraint, str] = OrderedDict()
        # Checks running on the pool: concurrent requests with one new constraint share its check.
        self._inflight: dict[Constraint, Future[str]] = {}
        self._lock = threading.Lock()

    def check(self, constraint: Constraint) -> str:
        """The constraint's checked grammar; ValueError (its message starting with the field) for a
        constraint the engine would refuse. Blocks the calling thread while a pool thread checks."""
        with self._lock:
            grammar = self._grammars.get(constraint)
            if grammar is not None:
                self._grammars.move_to_end(constraint)
                return grammar
        if self._pool is None:
            grammar = check_constraint(self.backend, constraint)
        else:
            grammar = self._on_pool(constraint)
        with self._lock:
            self._grammars[constraint] = grammar
            if len(self._grammars) > MAX_REMEMBERED:
                self._grammars.popitem(last=False)
        return grammar

    def _on_pool(self, constraint: Constraint) -> str:
        assert self._pool is not None
        with self._lock:
            future = self._inflight.get(constraint)
            if future is None:
                future = self._pool.submit(check_constraint, self.backend, constraint)
                self._inflight[constraint] = future
        try:
            return future.result()
        finally:
            with self._lock:
                self._inflight.pop(constraint, None)

    def warm_up(self) -> None:
        """Imports the backend's library in the background, so the first constrained request does
        not wait for it."""
        if self._pool is not None:
            self._pool.submit(load_backend_module, self.backend)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
