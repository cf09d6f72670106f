"""The package's shape: the import-linter contracts hold and can fail, no import cycle, no private name
crosses a module, package faces are docstrings, validating a config loads no torch, and the CLI's
command modules import nothing heavy at startup.

The layer rules themselves live in pyproject.toml (``[tool.importlinter]``), run by ``make lint``."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "cembed"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def module_name(path: Path) -> str:
    """``cembed/data/batching/full_table.py`` -> ``cembed.data.batching.full_table`` (a package's ``__init__`` -> the package)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST) -> set[str]:
    """Every ``cembed...`` module named by an import in ``tree`` (function-local imports included)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cembed":
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "cembed")
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the cembed modules it imports (names that are not modules are dropped)."""
    paths = {module_name(p): p for p in PKG.rglob("*.py")}
    return {
        name: {d for d in imported_modules(ast.parse(p.read_text())) if d in paths and d != name}
        for name, p in paths.items()
    }


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


def test_cembed_modules_have_no_import_cycle():
    graph = import_graph()
    assert "cembed.data.batching.full_table" in graph  # the walk sees the subpackages
    # a package face importing its own modules is not a cycle (losses/__init__ registers the built-ins)
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    assert find_cycles(graph) == []


def private_imports(path: Path) -> list[str]:
    """``module.name`` for each ``_private`` name ``path`` imports from a module of this repository: a
    cembed module, ``conftest``, a test module, or a sibling file (the scripts' own modules)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            ours = top in {"cembed", "conftest"} or top.startswith("test_") or (path.parent / f"{top}.py").exists()
            if ours:
                out += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return out


def test_no_private_name_crosses_a_module():
    files = [*PKG.rglob("*.py"), *(REPO / "scripts").rglob("*.py"), *(REPO / "tests").rglob("*.py")]
    crossing = {str(p.relative_to(REPO)): names for p in files if (names := private_imports(p))}
    assert crossing == {}


def test_private_import_check_sees_one(tmp_path):
    planted = tmp_path / "x.py"
    (tmp_path / "helpers.py").write_text("_shared = 1\n")
    planted.write_text(
        "from cembed.data.batching.full_table import _fits\nfrom helpers import _shared\nfrom torch import _C\n"
    )
    assert private_imports(planted) == ["cembed.data.batching.full_table._fits", "helpers._shared"]


def test_package_faces_hold_only_a_docstring():
    """``__init__.py`` states the package's job; only ``losses`` imports (its built-ins register)."""
    for init in PKG.rglob("__init__.py"):
        if init.parent.name == "samples":  # a data package: its face resolves `cembed:<name>`
            continue
        body = ast.parse(init.read_text()).body
        assert body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), init
        rest = [n for n in body[1:] if not (init.parent == PKG and isinstance(n, ast.Assign))]
        if init.parent.name == "losses":
            assert rest and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in rest), init
        else:
            assert rest == [], init


@pytest.mark.slow
def test_config_imports_no_torch():
    code = "import sys, cembed.config.file; print(sorted(m for m in ('torch','datasets','sentence_transformers','transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


# What a command module may import when ``cembed`` starts (before its arguments are read): the
# standard library, typer, rich and cembed's light modules; the rest is imported inside a command.
CLI_STARTUP_IMPORTS = {"typer", "rich", "cembed.cli", "cembed.errors", "cembed.files", "cembed.samples"}


def module_level_imports(tree: ast.Module) -> set[str]:
    """Modules imported when ``tree``'s module is imported: top-level imports, also under ``if``/``try``,
    but not under ``if TYPE_CHECKING:`` (never run) nor inside functions."""
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
            elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                visit(node.body), visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body), visit(node.orelse), visit(node.finalbody)

    visit(tree.body)
    return found


def test_cli_modules_import_only_light_modules_at_startup():
    """``cembed --help``, ``suggest-lr``, ``init --example`` and a config mistake answer in about a
    second because no command module imports torch, transformers, datasets, pydantic or cembed's
    data/model/train code at import time (tests/cli/test_app.py checks the loaded modules themselves)."""
    heavy = {}
    paths = sorted((PKG / "cli").rglob("*.py"))
    assert PKG / "cli" / "commands" / "train.py" in paths  # the command and display modules are checked too
    for path in paths:
        names = module_level_imports(ast.parse(path.read_text()))
        bad = [
            n
            for n in names
            if n.split(".")[0] not in sys.stdlib_module_names
            and not any(n == ok or n.startswith(ok + ".") for ok in CLI_STARTUP_IMPORTS)
        ]
        if bad:
            heavy[str(path.relative_to(PKG))] = sorted(bad)
    assert heavy == {}


def test_the_startup_import_check_sees_a_heavy_import():
    tree = ast.parse(
        "import os\nfrom typing import TYPE_CHECKING\nimport torch\nif TYPE_CHECKING:\n    import datasets\n"
        "def f():\n    import transformers\n"
    )
    assert module_level_imports(tree) == {"os", "typing", "torch"}


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is installed by `make install` (dev extra)")
def test_import_contracts_hold_and_an_upward_import_breaks_them(tmp_path):
    assert lint_imports(REPO).returncode == 0, lint_imports(REPO).stdout[-3000:]
    shutil.copytree(PKG, tmp_path / "cembed", ignore=shutil.ignore_patterns("__pycache__", "samples"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "cembed" / "samples").mkdir()
    shutil.copy(PKG / "samples" / "__init__.py", tmp_path / "cembed" / "samples")
    columns = tmp_path / "cembed" / "data" / "column_mapping.py"
    columns.write_text(columns.read_text() + "\n\ndef _upward():\n    from cembed.train import recipe  # noqa\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode != 0
    assert "cembed.data.column_mapping -> cembed.train.recipe" in broken.stdout
