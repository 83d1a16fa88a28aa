"""Runs programs. The @function body runs in the caller's thread and only *submits* expressions;
each program state has a worker thread that executes them in order against the backend. So a body
runs ahead until it reads a variable, fork branches generate in parallel, and run_batch overlaps
many programs in one server batch."""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from radixlm.lang import ir
from radixlm.lang.backend_api import BaseBackend, ProgramCall, Prompt
from radixlm.lang.speculative import ChatTurn, HeldText, eligible, speculative_params
from radixlm.lang.state_base import StateGroup, StateMethods
from radixlm_runtime.server.reasoning import ReasoningParser, Split
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)


class ProgramError(RuntimeError):
    """A program failed; the message says which program and which step."""


def describe(expr: ir.Expr) -> str:
    if isinstance(expr, ir.Gen):
        return f"gen({expr.name!r})"
    if isinstance(expr, ir.Select):
        return f"select({expr.name!r}, choices={expr.choices!r})"
    if isinstance(expr, ir.ConstantText):
        return f"text {expr.text[:40]!r}"
    return type(expr).__name__


@dataclass
class ProgramRun:
    """What the states of one run share: the backend, the body's thread, every forked executor
    (so the run's end can release all their sessions)."""

    name: str
    backend: BaseBackend
    defaults: ir.GenParams
    stream: bool
    num_api_spec_tokens: int | None = None
    body_thread: int | None = None
    body_done: bool = False
    executors: list[StreamExecutor] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Names the run in its calls' ProgramCall, shared by its forked streams.
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    def finish_body(self) -> None:
        with self.lock:
            executors = list(self.executors)
        for executor in executors:
            with executor._cond:
                self.body_done = True
                executor._cond.notify_all()


_STOP = object()


class StreamExecutor:
    def __init__(self, run: ProgramRun, arguments: dict[str, Any]) -> None:
        self.run = run
        self.arguments = arguments
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.cur_role: str | None = None
        self.cur_role_begin = 0
        self.var_scopes: dict[str, int] = {}
        self.fork_start = 0
        self.session_id = f"{run.name}-{uuid.uuid4().hex[:16]}"
        self.used_session = False
        # This stream's place in the run's call graph: its path ("0", a fork's branch "0/1"), how
        # many calls it made, and the id of the last call it (or, before its first, its parent) made.
        self.stream_path = "0"
        self.num_calls = 0
        self.last_call: str | None = None
        self.error: ProgramError | None = None
        self.finished = False
        # API speculative execution (see speculative.py): text generated ahead, and the assistant
        # turn being collected on a chat backend.
        self.held = HeldText()
        self.held_meta: dict[str, Any] = {}
        self.chat_turn: ChatTurn | None = None
        # (variable name or None, text, whether it is in the program's text) pieces, in order, for
        # text_iter; a separated reasoning is streamed under its variable but is not program text.
        self.chunks: list[tuple[str | None, str, bool]] = []
        self._pending = 0
        self._cond = threading.Condition()
        self._queue: queue.Queue[Any] = queue.Queue()
        with run.lock:
            run.executors.append(self)
        threading.Thread(target=self._worker, daemon=True, name=f"radixlm-{run.name}").start()

    # -- submission and waiting -----------------------------------------------------------------
    def submit(self, expr: ir.Expr) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put(expr)

    def _idle(self) -> bool:
        return self._pending == 0 and (self.run.body_done or threading.get_ident() == self.run.body_thread)

    def sync(self) -> None:
        """Waits until everything submitted ran, and (outside the body) until the body is done."""
        with self._cond:
            self._cond.wait_for(self._idle)
        self.raise_error()

    def drain(self) -> None:
        """Waits for what was submitted so far only: for workers, which must not wait on the body."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def get_var(self, name: str) -> Any:
        """Waits until name is set, or until nothing left to run could set it."""
        with self._cond:
            self._cond.wait_for(lambda: name in self.variables or self.error is not None or self._idle())
        if name in self.variables:
            return self.variables[name]
        self.raise_error()
        raise ProgramError(
            f"program {self.run.name!r}: variable {name!r} is not defined; "
            f"defined variables: {sorted(self.variables)}"
        )

    def set_var(self, name: str, value: Any) -> None:
        with self._cond:
            self.variables[name] = value
            self._cond.notify_all()

    def prompt(self, name: str) -> Prompt:
        """The program as one backend call sees it; `name` is the variable or primitive it serves."""
        self.used_session = True
        role_text = self.text_[self.cur_role_begin :] if self.cur_role else ""
        call_id = f"{self.stream_path}.{self.num_calls}"
        call = ProgramCall(f"{self.run.name}-{self.run.run_id}", call_id, self.last_call, name)
        self.num_calls += 1
        self.last_call = call_id
        return Prompt(self.text_, list(self.messages_), self.cur_role, role_text, self.session_id, call)

    # -- execution --------------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is _STOP:
                return
            try:
                if self.error is None:
                    self._execute(expr)
            except Exception as e:  # the program's error, reported where the program reads it
                err = ProgramError(f"program {self.run.name!r} failed at {describe(expr)}: {e}")
                err.__cause__ = e
                self.error = err
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _append(self, text: str, var: str | None = None, in_text: bool = True) -> None:
        with self._cond:
            if in_text:
                self.text_ += text
            self.chunks.append((var, text, in_text))
            self._cond.notify_all()

    def _execute(self, expr: ir.Expr) -> None:
        if self.chat_turn is not None and not isinstance(expr, (ir.ConstantText, ir.Gen, ir.RoleEnd)):
            raise ValueError(
                f"{type(expr).__name__} inside an assistant turn under num_api_spec_tokens: a chat model's "
                "turn is generated whole, so only constant text and gen can appear in it"
            )
        handler = _HANDLERS.get(type(expr))
        if handler is None:
            raise TypeError(f"cannot execute {type(expr).__name__}")
        handler(self, expr)

    def _execute_text(self, expr: ir.ConstantText) -> None:
        if self.chat_turn is not None:
            self.chat_turn.terms.append(expr.text)
            return
        self.held.fill(expr.text)
        self._append(expr.text)

    def _execute_gen(self, expr: ir.Gen) -> None:
        if self.chat_turn is not None:
            if expr.reasoning is not None:
                raise ValueError(
                    "separate_reasoning inside an assistant turn under num_api_spec_tokens: the turn is "
                    "generated in one call and matched term by term, which a think block would derail"
                )
            self.chat_turn.terms.append(expr)
            return
        params = expr.params.merged_over(self.run.defaults)
        parser = None if expr.reasoning is None else ReasoningParser(expr.reasoning)
        text = reasoning = ""
        meta: dict[str, Any] = {}
        for piece, piece_meta in self._gen_pieces(params, expr.name or "gen"):
            meta = piece_meta
            split = Split("", piece) if parser is None else parser.feed(piece)
            text += self._append_split(expr, split)
            reasoning += split.reasoning
        if parser is not None:
            split = parser.feed("", final=True)
            text += self._append_split(expr, split)
            self._record(expr.reasoning_name, reasoning + split.reasoning, meta)
        self._record(expr.name, text, meta)

    def _gen_pieces(self, params: ir.GenParams, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """A gen's output with its meta info: taken from text generated ahead (API speculative
        execution), streamed in pieces, or whole."""
        ahead = self.run.num_api_spec_tokens
        if ahead is not None and not self.run.stream and eligible(params):
            if not self.held.text:
                self.held.text, self.held_meta = self.run.backend.generate(
                    self.prompt(name), speculative_params(params, ahead)
                )
            yield self.held.take(params), self.held_meta
            return
        self.held = HeldText()
        if self.run.stream:
            yield from self.run.backend.generate_stream(self.prompt(name), params)
        else:
            yield self.run.backend.generate(self.prompt(name), params)

    def _append_split(self, expr: ir.Gen, split: Split) -> str:
        """Appends a piece of a gen's answer to the program's text; its reasoning is only streamed,
        under the reasoning variable. Returns the answer part."""
        if split.reasoning:
            self._append(split.reasoning, expr.reasoning_name, in_text=False)
        self._append(split.content, expr.name)
        return split.content

    def _execute_select(self, expr: ir.Select) -> None:
        decision = self.run.backend.select(
            self.prompt(expr.name or "select"), expr.choices, expr.temperature, expr.choices_method
        )
        self.held.fill(decision.decision)
        self._append(decision.decision, expr.name)
        self._record(expr.name, decision.decision, decision.meta_info)

    def _execute_role_begin(self, expr: ir.RoleBegin) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {expr.role!r} begins inside role {self.cur_role!r}")
        backend = self.run.backend
        self._append(backend.chat_template.begin(expr.role))
        self.cur_role, self.cur_role_begin = expr.role, len(self.text_)
        self.held = HeldText()
        spec = self.run.num_api_spec_tokens is not None and getattr(backend, "is_chat_model", False)
        if spec and expr.role == "assistant":
            self.chat_turn = ChatTurn()

    def _execute_role_end(self, expr: ir.RoleEnd) -> None:
        if self.cur_role != expr.role:
            raise ValueError(f"role {expr.role!r} ends but the current role is {self.cur_role!r}")
        if self.chat_turn is not None:
            self._generate_chat_turn()
        self.messages_.append({"role": expr.role, "content": self.text_[self.cur_role_begin :]})
        self._append(self.run.backend.chat_template.end(expr.role))
        self.cur_role = None

    def _execute_var_scope_begin(self, expr: ir.VarScopeBegin) -> None:
        self.var_scopes[expr.name] = len(self.text_)

    def _execute_var_scope_end(self, expr: ir.VarScopeEnd) -> None:
        self.set_var(expr.name, self.text_[self.var_scopes.pop(expr.name) :])

    def _execute_concate_and_append(self, expr: ir.ConcateAndAppend) -> None:
        for state in expr.states:
            branch = state.executor
            branch.drain()
            self._append(branch.text_[branch.fork_start :])

    def _execute_commit_lazy(self, expr: ir.CommitLazy) -> None:
        if self.text_:
            self.run.backend.commit_lazy(self.prompt("prefix"))

    def _generate_chat_turn(self) -> None:
        """One chat completion for the collected assistant turn, matched term by term."""
        turn, self.chat_turn = self.chat_turn, None
        assert turn is not None and self.run.num_api_spec_tokens is not None
        params = [t.params.merged_over(self.run.defaults) for t in turn.terms if isinstance(t, ir.Gen)]
        if not params:
            self._append("".join(t for t in turn.terms if isinstance(t, str)))
            return
        if not all(eligible(p) for p in params):
            raise ValueError(
                "a constrained or logprob gen inside an assistant turn under num_api_spec_tokens: the "
                "turn is generated in one call, so its gens cannot carry their own constraints"
            )
        message, meta = self.run.backend.generate(
            self.prompt("assistant turn"), speculative_params(params[0], self.run.num_api_spec_tokens)
        )
        for text, name in turn.match(message, params):
            self._append(text, name)
            self._record(name, text, meta)

    def _record(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is not None:
            self.meta_info[name] = meta
            self.set_var(name, value)

    def _execute_end_program(self, expr: ir.EndProgram) -> None:
        """Waits for fork branches, releases every pinned session of the run, stops the workers."""
        others = [e for e in self.run.executors if e is not self]
        for branch in others:
            with branch._cond:
                branch._cond.wait_for(lambda b=branch: b._pending == 0)
        for executor in self.run.executors:
            if executor.used_session:
                try:
                    self.run.backend.end_session(executor.session_id)
                except Exception as e:  # pins also expire on the server; never fail a finished run
                    logger.warning("could not release session %s: %s", executor.session_id, e)
        for executor in self.run.executors:
            with executor._cond:
                executor.finished = True
                executor._cond.notify_all()
            executor._queue.put(_STOP)

    def fork(self, size: int) -> list[StreamExecutor]:
        if size > 1:
            self.submit(ir.CommitLazy())
        self.sync()
        branches = []
        for _ in range(size):
            branch = StreamExecutor(self.run, self.arguments)
            branch.text_ = self.text_
            branch.messages_ = list(self.messages_)
            branch.variables = dict(self.variables)
            branch.meta_info = dict(self.meta_info)
            branch.cur_role, branch.cur_role_begin = self.cur_role, self.cur_role_begin
            branch.fork_start = len(self.text_)
            branch.stream_path = f"{self.stream_path}/{len(branches)}"
            branch.last_call = self.last_call
            branches.append(branch)
        return branches


# Each IR node's step, looked up by exact type: the node classes are leaves under ir.Expr.
_HANDLERS: dict[type[ir.Expr], Callable[[StreamExecutor, Any], None]] = {
    ir.ConstantText: StreamExecutor._execute_text,
    ir.Gen: StreamExecutor._execute_gen,
    ir.Select: StreamExecutor._execute_select,
    ir.RoleBegin: StreamExecutor._execute_role_begin,
    ir.RoleEnd: StreamExecutor._execute_role_end,
    ir.VarScopeBegin: StreamExecutor._execute_var_scope_begin,
    ir.VarScopeEnd: StreamExecutor._execute_var_scope_end,
    ir.ConcateAndAppend: StreamExecutor._execute_concate_and_append,
    ir.CommitLazy: StreamExecutor._execute_commit_lazy,
    ir.EndProgram: StreamExecutor._execute_end_program,
}


class ProgramState(StateMethods):
    """The `s` of a program: append with +=, read variables with s["name"]."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.executor = executor
        self.ret_value: Any = None

    def __iadd__(self, other: Any) -> ProgramState:
        if isinstance(other, ProgramState):
            raise TypeError("cannot append a program state; append its text with s += other.text()")
        for expr in ir.flatten(ir.to_expr(other)):
            self.executor.submit(expr)
        return self

    def __getitem__(self, name: str) -> Any:
        return self.executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.set_var(name, value)

    get_var = __getitem__
    set_var = __setitem__

    def get_meta_info(self, name: str) -> dict[str, Any]:
        self.executor.get_var(name)
        return self.executor.meta_info.get(name, {})

    def text(self) -> str:
        self.executor.sync()
        return self.executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.executor.sync()
        return list(self.executor.messages_)

    def sync(self) -> ProgramState:
        self.executor.sync()
        return self

    def error(self) -> ProgramError | None:
        return self.executor.error

    def fork(self, size: int = 1) -> ProgramStateGroup:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork: size must be a positive int, got {size!r}")
        return ProgramStateGroup([ProgramState(e) for e in self.executor.fork(size)], self)

    def _submit(self, expr: ir.Expr) -> None:
        self.executor.submit(expr)

    # -- streaming --------------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yields text as it is generated (run with stream=True); with var_name, only that
        variable's text, until it is complete."""
        executor = self.executor
        if not executor.run.stream:
            yield self.get_var(var_name) if var_name else self.text()
            return
        sent = 0
        while True:
            with executor._cond:
                executor._cond.wait_for(
                    lambda n=sent: len(executor.chunks) > n or executor.finished or executor.error is not None
                )
                new = executor.chunks[sent:]
                sent += len(new)
                done = (
                    executor.finished
                    or executor.error is not None
                    or (var_name is not None and var_name in executor.variables)
                ) and sent == len(executor.chunks)
            for var, text, in_text in new:
                if text and (var == var_name if var_name is not None else in_text):
                    yield text
            if done:
                executor.raise_error()
                if var_name is not None and var_name not in executor.variables:
                    executor.get_var(var_name)
                return

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup(StateGroup[ProgramState]):
    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable set in the branches becomes a list on the parent.
        concate_and_append: the branches' texts are appended to the parent, in order."""
        self.check_mode(mode)
        if mode == "gather_variable":
            for state in self.states:
                state.executor.sync()
            parent = self.parent.executor
            names: list[str] = []
            for state in self.states:
                branch = state.executor
                changed = [k for k, v in branch.variables.items() if parent.variables.get(k, _STOP) is not v]
                names += [k for k in changed if k not in names]
            for name in names:
                parent.set_var(name, [s.executor.variables.get(name) for s in self.states])
        else:
            self.parent += ir.ConcateAndAppend(self.states)


def run_program(
    name: str,
    func: Callable[..., Any],
    backend: BaseBackend,
    arguments: dict[str, Any],
    defaults: ir.GenParams,
    stream: bool = False,
    sync: bool = False,
    num_api_spec_tokens: int | None = None,
) -> ProgramState:
    run = ProgramRun(name, backend, defaults, stream, num_api_spec_tokens)
    state = ProgramState(StreamExecutor(run, arguments))

    def body() -> None:
        run.body_thread = threading.get_ident()
        try:
            state.ret_value = func(state, **arguments)
        finally:
            state.executor.submit(ir.EndProgram())
            run.finish_body()

    if stream:

        def body_in_thread() -> None:
            try:
                body()
            except Exception as e:  # surfaced by text_iter / text() in the reading thread
                err = ProgramError(f"program {name!r} failed: {e}")
                err.__cause__ = e
                state.executor.error = err

        threading.Thread(target=body_in_thread, daemon=True, name=f"radixlm-body-{name}").start()
        return state
    body()
    if sync:
        state.sync()
    return state
