"""The package's floors (docs/architecture.md): every module of fastes/ sits in a declared layer and
imports only from its own layer or lower ones; the Triton kernels import nothing of fastes outside
themselves; no modules of fastes/ or benchmarks/ import each other in a loop; nothing imports the
command line.

The graph is read with `ast`, so it includes imports inside functions: a lazy import hides a loop or an
upward dependency from Python but not from a reader. A package's `__init__` counts only when a name
defined there is imported (`from fastes import ES`), not as the parent of every submodule.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fastes", "benchmarks")

# The layers of fastes, bottom to top. "pkg.*" is the package pkg and everything in it; a name without
# ".*" is that one module. A module may import its own layer and the layers below it, never above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # errors, the version, collectives across processes, crash-safe checkpoint files
    ("base", ("fastes.errors", "fastes.version", "fastes.distributed", "fastes.checkpoint")),
    ("engine", ("fastes.engine.*",)),  # the noise contract and its backends: torch, C library, Triton
    ("es", ("fastes.es.*",)),  # the ES optimizer, reward shaping, evolved weights, population evaluation
    ("tasks", ("fastes.tasks.*",)),  # tasks, verifiers and reward functions
    ("models", ("fastes.models.*",)),  # loading, sources, adapters, generation
    ("analysis", ("fastes.analysis.*",)),  # measurements on tensors and arrays
    ("run", ("fastes.run.*",)),  # config, automatic settings, run directory, the loops, evaluation
    # what users call
    ("faces", ("fastes", "fastes.__main__", "fastes.cli", "fastes.trainer.*", "fastes.experiment.*")),
)
SELF_CONTAINED = ("fastes.engine.kernels",)  # packages that import nothing of fastes outside themselves


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


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index of `module`'s layer in `layers`, or None when no layer declares it."""
    for index, (_, members) in enumerate(layers):
        for member in members:
            if module == member or (member.endswith(".*") and in_package(module, member[:-2])):
                return index
    return None


def layer_problems(graph: dict[str, set[str]], layers=LAYERS, self_contained=SELF_CONTAINED) -> list[str]:
    """Every module of fastes outside the layers, every import pointing to a higher layer, and every
    import leaving a self-contained package, one line each."""
    problems = []
    for module in sorted(m for m in graph if in_package(m, "fastes")):
        layer = layer_of(module, layers)
        if layer is None:
            problems.append(f"{module} is in no layer")
            continue
        for target in sorted(t for t in graph[module] if in_package(t, "fastes")):
            target_layer = layer_of(target, layers)
            if target_layer is not None and target_layer > layer:
                names = layers[layer][0], layers[target_layer][0]
                problems.append(f"{module} ({names[0]}) imports {target} ({names[1]}), a higher layer")
            for package in self_contained:
                if in_package(module, package) and not in_package(target, package):
                    problems.append(f"{module} imports {target}, outside {package}")
    return problems


def test_every_module_is_in_a_layer_and_imports_only_downwards():
    problems = layer_problems(import_graph())
    assert not problems, "\n".join(problems)


def test_no_import_loops():
    loops = import_loops(import_graph())
    assert not loops, "import loops: " + "; ".join(" <-> ".join(loop) for loop in loops)


def test_nothing_imports_the_command_line():
    graph = import_graph()
    importers = [name for name, deps in graph.items() if "fastes.cli" in deps]
    assert importers == ["fastes.__main__"]  # `python -m fastes` is the command line itself


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


FAKE_LAYERS = (("low", ("fastes.low.*",)), ("high", ("fastes.high",)))


@pytest.mark.parametrize(
    "files, problem",
    [
        ({"low/__init__.py": "", "low/a.py": "import os\n", "high.py": "from .low import a\n"}, None),
        (
            {"low/__init__.py": "", "low/a.py": "def f():\n    from fastes import high\n", "high.py": ""},
            "fastes.low.a (low) imports fastes.high (high), a higher layer",
        ),
        (
            {"low/__init__.py": "", "low/a.py": "from ..high import x\n", "high.py": "x = 1\n"},
            "fastes.low.a (low) imports fastes.high (high), a higher layer",
        ),
        ({"low/__init__.py": "", "other.py": ""}, "fastes.other is in no layer"),
        (
            {"low/__init__.py": "", "low/k/__init__.py": "", "low/k/a.py": "from fastes.low import b\n"},
            "fastes.low.k.a imports fastes.low.b, outside fastes.low.k",
        ),
    ],
)
def test_the_layer_check_finds_upward_imports(tmp_path, monkeypatch, files, problem):
    """The checker itself: an upward import (lazy or relative), a module in no layer, and an import
    leaving a self-contained package are each reported."""
    files = {"__init__.py": "", "low/b.py": "", **files}
    for name, text in files.items():
        (tmp_path / "fastes" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fastes" / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("fastes",))
    found = layer_problems(import_graph(), FAKE_LAYERS + (("top", ("fastes",)),), ("fastes.low.k",))
    assert found == ([] if problem is None else [problem])
