"""The package's modules import each other without loops, and nothing imports the command line.

The graph is read with `ast`, so it includes imports inside functions: a lazy import hides a loop from
Python but not from a reader. A package's `__init__` counts only when a name defined there is imported
(`from fastes import ES`), not as the parent of every submodule.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fastes", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules that `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return loops


def test_no_import_loops():
    loops = import_loops(import_graph())
    assert not loops, "import loops: " + "; ".join(" <-> ".join(loop) for loop in loops)


def test_nothing_imports_the_command_line():
    graph = import_graph()
    assert not [name for name, deps in graph.items() if "fastes.cli" in deps]


@pytest.mark.parametrize(
    "files, loop",
    [
        ({"a.py": "from . import b\n", "b.py": "def f():\n    from .a import x\n"}, ["pkg.a", "pkg.b"]),
        (
            {"a.py": "import pkg.b\n", "b.py": "from pkg import c\n", "c.py": "from .a import y\n"},
            ["pkg.a", "pkg.b", "pkg.c"],
        ),
        ({"__init__.py": "from .a import X\n", "a.py": "from pkg import X\n"}, ["pkg", "pkg.a"]),
        ({"a.py": "from . import b\n", "b.py": "import os\n"}, None),
    ],
)
def test_the_loop_finder_finds_loops(tmp_path, monkeypatch, files, loop):
    """The checker itself: it sees loops through relative, absolute, lazy and __init__ imports."""
    (tmp_path / "pkg").mkdir()
    for name, text in {"__init__.py": "", **files}.items():
        (tmp_path / "pkg" / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("pkg",))
    assert import_loops(import_graph()) == ([] if loop is None else [loop])
