"""Tracing: runs a program body against placeholders instead of a backend and records what it
appends, giving its call graph: constant text, argument text, gen/select nodes, roles, forks.

Arguments and variables stand in as placeholder objects. Concatenated or formatted into text they
become sentinel strings, split back into graph nodes when appended; used in Python control flow
(iterated, tested for truth) they stop the trace, which is then marked truncated.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from radixlm.lang import ir
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.state_base import StateGroup, StateMethods


class StopTracing(Exception):
    pass


@dataclass(eq=False)
class Argument:
    name: str


@dataclass(eq=False)
class VarRef:
    name: str


@dataclass(eq=False)
class ForkNode:
    size: int
    branches: list[list[Any]] = field(default_factory=list)


@dataclass(eq=False)
class JoinNode:
    mode: str


Node = (
    Any  # ir.ConstantText | ir.Gen | ir.Select | ir.RoleBegin | ... | Argument | VarRef | ForkNode | JoinNode
)

_SENTINEL = re.compile("\x00(arg|var):([^\x00]*)\x00")


class Placeholder:
    """An argument or variable whose value is unknown while tracing."""

    def __init__(self, kind: str, name: str) -> None:
        self._kind, self._name = kind, name

    def __str__(self) -> str:
        return f"\x00{self._kind}:{self._name}\x00"

    def __format__(self, spec: str) -> str:
        return str(self)

    def __add__(self, other: Any) -> Any:
        return str(self) + other if isinstance(other, str) else ir.ConstantText(str(self)) + other

    def __radd__(self, other: Any) -> Any:
        return other + str(self) if isinstance(other, str) else other + ir.ConstantText(str(self))

    def __getitem__(self, key: Any) -> Placeholder:
        return Placeholder(self._kind, f"{self._name}[{key!r}]")

    def __iter__(self) -> Iterator[Any]:
        raise StopTracing(f"{self._kind} {self._name!r} is iterated in Python code")

    def __len__(self) -> int:
        raise StopTracing(f"{self._kind} {self._name!r} is measured in Python code")

    def __bool__(self) -> bool:
        raise StopTracing(f"{self._kind} {self._name!r} is tested in Python control flow")


def _split_sentinels(text: str) -> list[Node]:
    nodes: list[Node] = []
    pos = 0
    for m in _SENTINEL.finditer(text):
        if m.start() > pos:
            nodes.append(ir.ConstantText(text[pos : m.start()]))
        nodes.append(Argument(m.group(2)) if m.group(1) == "arg" else VarRef(m.group(2)))
        pos = m.end()
    if pos < len(text):
        nodes.append(ir.ConstantText(text[pos:]))
    return nodes


@dataclass
class CallGraph:
    name: str
    arg_names: list[str]
    nodes: list[Node]
    truncated: str | None = None  # why tracing stopped early, if it did

    def walk(self) -> Iterator[Node]:
        def visit(nodes: list[Node]) -> Iterator[Node]:
            for node in nodes:
                yield node
                if isinstance(node, ForkNode):
                    for branch in node.branches:
                        yield from visit(branch)

        return visit(self.nodes)

    def gen_nodes(self) -> list[ir.Gen | ir.Select]:
        return [n for n in self.walk() if isinstance(n, ir.Gen | ir.Select)]

    def leading_text(self, template: ChatTemplate) -> str:
        """The prompt text every run of this graph starts with: everything before the first node
        whose text is not known (an argument placeholder, a gen, a select, a fork)."""
        out = []
        for node in self.nodes:
            if isinstance(node, ir.ConstantText):
                out.append(node.text)
            elif isinstance(node, ir.RoleBegin):
                out.append(template.begin(node.role))
            elif isinstance(node, ir.RoleEnd):
                out.append(template.end(node.role))
            elif not isinstance(node, ir.VarScopeBegin | ir.VarScopeEnd):
                break
        return "".join(out)

    def __str__(self) -> str:
        lines = [f"CallGraph {self.name}({', '.join(self.arg_names)})"]
        _format_nodes(self.nodes, 1, lines)
        if self.truncated:
            lines.append(f"  ... trace stopped: {self.truncated}")
        return "\n".join(lines)


def _format_nodes(nodes: list[Node], depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for node in nodes:
        if isinstance(node, ir.ConstantText):
            lines.append(f"{pad}text {node.text!r}")
        elif isinstance(node, Argument):
            lines.append(f"{pad}arg {node.name}")
        elif isinstance(node, VarRef):
            lines.append(f"{pad}var {node.name}")
        elif isinstance(node, ir.Gen):
            params = {k: v for k, v in vars(node.params).items() if v is not None}
            lines.append(f"{pad}gen {node.name!r} {params}")
        elif isinstance(node, ir.Select):
            lines.append(f"{pad}select {node.name!r} choices={node.choices}")
        elif isinstance(node, ir.RoleBegin | ir.RoleEnd):
            kind = "begin" if isinstance(node, ir.RoleBegin) else "end"
            lines.append(f"{pad}role {node.role} {kind}")
        elif isinstance(node, ir.VarScopeBegin | ir.VarScopeEnd):
            kind = "begin" if isinstance(node, ir.VarScopeBegin) else "end"
            lines.append(f"{pad}var_scope {node.name} {kind}")
        elif isinstance(node, ForkNode):
            lines.append(f"{pad}fork {node.size}")
            for i, branch in enumerate(node.branches):
                lines.append(f"{pad}  branch {i}")
                _format_nodes(branch, depth + 2, lines)
        elif isinstance(node, JoinNode):
            lines.append(f"{pad}join {node.mode}")


class TracerState(StateMethods):
    """Stands in for ProgramState while tracing; same API, records instead of running."""

    def __init__(self, stop_at_first_gen: bool = False) -> None:
        self.nodes: list[Node] = []
        self.stop_at_first_gen = stop_at_first_gen
        self.variables: dict[str, Any] = {}

    def __iadd__(self, other: Any) -> TracerState:
        for expr in ir.flatten(ir.to_expr(other if not isinstance(other, Placeholder) else str(other))):
            self._record(expr)
        return self

    def _record(self, expr: ir.Expr) -> None:
        if isinstance(expr, ir.ConstantText):
            self.nodes += _split_sentinels(expr.text)
            return
        if isinstance(expr, ir.ConcateAndAppend):
            self.nodes.append(JoinNode("concate_and_append"))
            return
        if isinstance(expr, ir.Gen | ir.Select) and self.stop_at_first_gen:
            raise StopTracing("first gen reached")
        self.nodes.append(expr)

    def __getitem__(self, name: str) -> Any:
        return self.variables.get(name, Placeholder("var", name))

    def __setitem__(self, name: str, value: Any) -> None:
        self.variables[name] = value

    get_var = __getitem__
    set_var = __setitem__

    def get_meta_info(self, name: str) -> dict[str, Any]:
        raise StopTracing(f"program reads the meta info of {name!r}")

    def text(self) -> str:
        raise StopTracing("program reads its own text")

    def messages(self) -> list[dict[str, str]]:
        raise StopTracing("program reads its own messages")

    def sync(self) -> TracerState:
        return self

    def fork(self, size: int = 1) -> TracerGroup:
        node = ForkNode(size)
        self.nodes.append(node)
        branches = [TracerState(self.stop_at_first_gen) for _ in range(size)]
        node.branches = [b.nodes for b in branches]
        return TracerGroup(branches, self)

    def _submit(self, expr: ir.Expr) -> None:
        self._record(expr)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        raise StopTracing("program streams its own text")


class TracerGroup(StateGroup[TracerState]):
    def join(self, mode: str = "gather_variable") -> None:
        self.check_mode(mode)
        self.parent.nodes.append(JoinNode(mode))


def trace_program(
    name: str, func: Any, arg_names: list[str], arguments: dict[str, Any], stop_at_first_gen: bool = False
) -> CallGraph:
    """Traces func with the given arguments; missing ones become placeholders."""
    bound = {n: arguments[n] if n in arguments else Placeholder("arg", n) for n in arg_names}
    state = TracerState(stop_at_first_gen)
    truncated = None
    try:
        func(state, **bound)
    except StopTracing as e:
        truncated = str(e)
    except Exception as e:  # placeholders reach code that needs real values
        truncated = f"{type(e).__name__}: {e}"
    return CallGraph(name, arg_names, state.nodes, truncated)
