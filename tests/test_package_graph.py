"""The layering of both packages, read from the source: no package-level import cycle, and the
scheduler never loads torch (the executor owns every tensor)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("radixlm", "radixlm_runtime")


def _node(module: str) -> str | None:
    """A module's node in the graph: its first-level subpackage (`radixlm_runtime.scheduler`), or
    the module itself when it sits directly in a top package (`radixlm_runtime.step`)."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if len(parts) == 1:
        return parts[0]
    sub = ROOT.joinpath(*parts[:2])
    return ".".join(parts[:2]) if sub.is_dir() or sub.with_suffix(".py").exists() else parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """Line numbers inside `if TYPE_CHECKING:` blocks: type-only imports create no runtime edge."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(path: Path) -> set[str]:
    """Every module path imports, at any depth (imports inside functions count too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_blocks(tree)
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            src = _node(_module_name(path))
            assert src is not None
            for imported in _imports(path):
                dst = _node(imported)
                if dst is not None and dst != src and not imported.startswith(f"{src}."):
                    graph[src].add(dst)
            graph.setdefault(src, set())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_is_read_from_the_source() -> None:
    graph = package_graph()
    assert "radixlm_runtime.executor" in graph["radixlm_runtime.entrypoints"]
    assert "radixlm_runtime.forward_batch" in graph["radixlm_runtime.attention"]
    assert "radixlm_runtime.server_args" in graph["radixlm.backend"]


def test_no_package_level_import_cycle() -> None:
    assert cycles(package_graph()) == []


@pytest.mark.parametrize(
    "module",
    ["radixlm_runtime.scheduler.scheduler", "radixlm_runtime.step", "radixlm_runtime.io.messages"],
)
def test_scheduler_side_never_loads_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_scheduler_package_imports_no_torch() -> None:
    for path in (ROOT / "radixlm_runtime" / "scheduler").glob("*.py"):
        assert not any(m.split(".")[0] == "torch" for m in _imports(path)), path.name
