"""Constrained requests wait here while their constraint compiles in the background, so the step
loop never waits for a compile while other requests can run."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from radixlm_runtime.constrained.backend import make_backend
from radixlm_runtime.constrained.compiler import GrammarCompiler
from radixlm_runtime.constrained.completion import shortest_completion, single_byte_tokens
from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.scheduler.req import Req

# How long a step with nothing to run waits for a compile: long enough not to spin, short enough
# that the server loop keeps reading new requests.
COMPILE_POLL_S = 0.01
# Steps the search for a request's shortest output may take at submission (about 30 µs each).
MAX_COMPLETION_STEPS = 1024


class ConstraintQueue:
    def __init__(self, tokenizer: Any, eos_ids: frozenset[int], vocab_size: int, backend: str) -> None:
        # The backend indexes the vocabulary on the first constrained request, on a compile thread,
        # so unconstrained use pays nothing at start-up.
        self.compiler = GrammarCompiler(lambda: make_backend(backend, tokenizer, eos_ids, vocab_size))
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compiling: list[tuple[Req, Future[Any]]] = []

    def submit(self, req: Req) -> None:
        constraint = req.sampling_params.constraint
        assert constraint is not None, "only constrained requests wait for a compile"
        self.compiling.append((req, self.compiler.submit(constraint, req.grammar)))

    def __len__(self) -> int:
        return len(self.compiling)

    def collect(self) -> list[Req]:
        """Requests whose compile is done: each gets its own guide, or a finish reason when it is
        refused (`_start`)."""
        if not any(f.done() for _, f in self.compiling):
            return []
        done: list[Req] = []
        pending: list[tuple[Req, Future[Any]]] = []
        for req, future in self.compiling:
            if not future.done():
                pending.append((req, future))
                continue
            req.finished_reason = self._start(req, future)
            done.append(req)
        self.compiling = pending
        return done

    def _start(self, req: Req, compiled: Future[Any]) -> FinishReason | None:
        """Gives req its guide; refuses (an abort naming the field, a 400 over HTTP) before anything
        runs a constraint that did not compile, that the vocabulary cannot start (bytes it needs
        first that no token spells), that the grammar engine gives up on along its shortest output
        (e.g. llguidance's ParserTooComplex on a wide schema), or a max_new_tokens below the shortest
        output the constraint admits (as found by `shortest_completion`, an upper bound; where its
        walk finds none, nothing is refused)."""
        constraint = req.sampling_params.constraint
        assert constraint is not None
        refuse = lambda message: FinishReason.abort(str(constraint.error(message)), param=constraint.kind)
        exc = compiled.exception()
        if exc is not None:
            return refuse(str(exc))
        req.guide = self.compiler.guide(compiled.result())
        if not req.guide.allowed_mask(self.vocab_size).any():
            return refuse("no token sequence of this model's vocabulary can match it")
        budget = req.sampling_params.max_new_tokens
        if budget == 0:
            return None
        limit = min(4 * budget + 256, MAX_COMPLETION_STEPS)
        tokens = single_byte_tokens(self.tokenizer)
        need = shortest_completion(req.guide, tokens, self._encode, self.vocab_size, limit)
        error = req.guide.error()
        if error is not None:
            return refuse(f"the grammar engine gave up on it: {error}")
        req.shortest_output = len(need) if need is not None else 0
        if need is not None and len(need) > budget:
            return FinishReason.abort(
                f"max_new_tokens: {budget} is fewer than the {len(need)} tokens the shortest output of "
                f"this {constraint.kind} takes",
                param="max_new_tokens",
            )
        return None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def wait(self) -> None:
        """Blocks briefly until some compile finishes (when nothing else can run)."""
        wait([f for _, f in self.compiling], timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)

    def drop(self, aborted: set[str]) -> list[Req]:
        gone = [r for r, _ in self.compiling if r.rid in aborted]
        self.compiling = [(r, f) for r, f in self.compiling if r.rid not in aborted]
        return gone
