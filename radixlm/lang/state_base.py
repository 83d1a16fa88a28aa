"""What a running program state and a tracing one share: the role and var_scope helpers (both only
submit IR nodes) and the fork group."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from radixlm.lang import ir


class StateMethods:
    """Needs `__iadd__` and `_submit(expr)` from the state class."""

    def _submit(self, expr: ir.Expr) -> None:
        raise NotImplementedError

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            self += ir.role_expr(role, expr)
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self._submit(ir.RoleBegin(role))
        yield
        self._submit(ir.RoleEnd(role))

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Captures the text appended inside the block as variable `name`."""
        self._submit(ir.VarScopeBegin(name))
        yield
        self._submit(ir.VarScopeEnd(name))


S = TypeVar("S")
JOIN_MODES = ("gather_variable", "concate_and_append")


class StateGroup(Generic[S]):
    """The branches of s.fork(n); `forks += lambda i: ...` appends to each branch by index."""

    def __init__(self, states: list[S], parent: S) -> None:
        self.states = states
        self.parent = parent

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> S:
        return self.states[i]

    def __setitem__(self, i: int, state: S) -> None:
        """Completes `forks[i] += ...` (which appends in place, then assigns back)."""
        if state is not self.states[i]:
            raise TypeError("fork branches cannot be replaced; append to them with forks[i] += ...")

    def __iter__(self) -> Iterator[S]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> StateGroup[S]:
        for i, state in enumerate(self.states):
            if isinstance(other, list):
                state += other[i]
            elif callable(other) and not isinstance(other, ir.Expr):
                state += other(i)
            else:
                state += other
        return self

    @staticmethod
    def check_mode(mode: str) -> None:
        if mode not in JOIN_MODES:
            raise ValueError(f"join: mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
