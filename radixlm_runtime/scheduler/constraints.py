"""Constrained requests wait here while their regex / JSON schema compiles in the background, so
the step loop never waits for a compile while other requests can run."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from radixlm_runtime.constrained.compiler import ConstraintCompiler
from radixlm_runtime.constrained.grammar import RegexGuide
from radixlm_runtime.constrained.regex_fsm import TokenIndex, TokenVocab
from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.scheduler.req import Req

# How long a step with nothing to run waits for a compile: long enough not to spin, short enough
# that the server loop keeps reading new requests.
COMPILE_POLL_S = 0.01


class ConstraintQueue:
    def __init__(self, tokenizer: Any, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        # Built on the first constrained request, so unconstrained use pays nothing at start-up.
        self._compiler: ConstraintCompiler | None = None
        self.compiling: list[tuple[Req, Future[TokenIndex]]] = []

    def compiler(self) -> ConstraintCompiler:
        if self._compiler is None:
            vocab = TokenVocab.from_tokenizer(self.tokenizer, eos_ids=sorted(self.eos_ids))
            self._compiler = ConstraintCompiler(vocab)
        return self._compiler

    def vocab_texts(self) -> list[str]:
        return self.compiler().vocab.texts

    def submit(self, req: Req) -> None:
        sp = req.sampling_params
        self.compiling.append((req, self.compiler().submit_constraint(sp.regex, sp.json_schema)))

    def __len__(self) -> int:
        return len(self.compiling)

    def collect(self) -> list[Req]:
        """Requests whose compile is done: each gets its own guide, or a finish reason when its
        constraint did not compile."""
        if not any(f.done() for _, f in self.compiling):
            return []
        done: list[Req] = []
        pending: list[tuple[Req, Future[TokenIndex]]] = []
        for req, future in self.compiling:
            if not future.done():
                pending.append((req, future))
                continue
            exc = future.exception()
            if exc is not None:
                field_name = "regex" if req.sampling_params.regex is not None else "json_schema"
                message = str(exc) if str(exc).startswith(field_name) else f"{field_name}: {exc}"
                req.finished_reason = FinishReason.abort(message, param=field_name)
            else:
                req.guide = RegexGuide(future.result())
            done.append(req)
        self.compiling = pending
        return done

    def wait(self) -> None:
        """Blocks briefly until some compile finishes (when nothing else can run)."""
        wait([f for _, f in self.compiling], timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)

    def drop(self, aborted: set[str]) -> list[Req]:
        gone = [r for r, _ in self.compiling if r.rid in aborted]
        self.compiling = [(r, f) for r, f in self.compiling if r.rid not in aborted]
        return gone
