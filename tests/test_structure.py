"""The package's shape: imports run one way, only the CLI and the reporting module print."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "cembed"


def import_graph() -> dict[str, set[str]]:
    """Module name -> cembed modules it imports, function-local imports included."""
    modules = {p.stem for p in PKG.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in PKG.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("cembed."):
                    deps.add(node.module.split(".")[1])
                elif node.module == "cembed":
                    deps.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[1] for a in node.names if a.name.startswith("cembed."))
        graph[path.stem] = {d for d in deps if d in modules and d != path.stem}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk (each as the path that closes it)."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                walk(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [])
    return cycles


def test_find_cycles_sees_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_cembed_imports_have_no_cycle():
    assert find_cycles(import_graph()) == []


def test_only_cli_and_report_import_rich():
    printers = set()
    for path in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n and n.split(".")[0] == "rich" for n in names):
                printers.add(path.stem)
    assert printers <= {"cli", "report"}, printers


def test_no_module_over_450_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PKG.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 450} == {}
