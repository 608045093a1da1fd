"""The architecture's rules, checked on the source: no import cycles between our modules (counting every import,
lazy and type-only ones too), scripts import nothing from tests, the scheduler never imports torch, the worker
never imports grpc."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.unit

PACKAGES = ("proto", "scheduler_node", "worker_node", "kernels", "minivllm")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module this file imports, anywhere in it (top level, functions, TYPE_CHECKING blocks)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_scripts_import_nothing_from_tests() -> None:
    offenders = {
        p.name: sorted(m for m in imports_of(p) if m == "tests" or m.startswith("tests."))
        for p in (REPO / "scripts").glob("*.py")
    }
    assert not {name: mods for name, mods in offenders.items() if mods}


def test_the_scheduler_never_imports_torch_and_the_worker_never_imports_grpc() -> None:
    for name, path in our_modules().items():
        roots = {m.split(".")[0] for m in imports_of(path)}
        if name.startswith("scheduler_node"):
            assert "torch" not in roots, f"{name} imports torch"
        if name.startswith("worker_node"):
            assert "grpc" not in roots and "grpc_health" not in roots, f"{name} imports grpc"
