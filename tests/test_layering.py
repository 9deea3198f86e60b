"""The package's layering: no import cycle between its modules, and only shard_planner.cli imports the CLI.

The graph has an edge A -> B for every ``import`` statement in module A (at any depth, so an import
inside a function counts too) that names module B of the package (``from pkg import name`` names
``pkg.name`` where that is a module, else ``pkg``).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import shard_planner

PACKAGE_DIR = Path(shard_planner.__file__).resolve().parent

# Import cycles that another branch removes: the lead deletes an entry at merge. Each is the cycle's
# set of modules.
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


def module_names() -> dict[str, Path]:
    """Every module of the package -> its file (a package is its __init__.py)."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules its import statements name."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, is_package, node.module, node.level)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            edges |= {_nearest_module(t, modules) for t in targets}
        graph[name] = edges - {None, name}
    return graph


def _absolute(name: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _nearest_module(target: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``target`` that is a package module (None outside the package)."""
    parts = target.split(".")
    for k in range(len(parts), 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in modules:
            return candidate
    return None


def find_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan), as sets of modules;
    a module importing itself is not counted (import_graph drops self-edges)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_find_cycles_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [frozenset({"a", "b", "c"})]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_resolves_relative_and_from_imports(tmp_path):
    pkg = tmp_path / "shard_planner"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("from ..top import x\ndef f():\n    import shard_planner.sub\n")
    (pkg / "top.py").write_text("from shard_planner.sub import leaf\nimport os\n")
    modules = {"shard_planner": pkg / "__init__.py", "shard_planner.sub": pkg / "sub" / "__init__.py",
               "shard_planner.sub.leaf": pkg / "sub" / "leaf.py", "shard_planner.top": pkg / "top.py"}
    graph = import_graph(modules)
    assert graph["shard_planner.sub"] == {"shard_planner.sub.leaf"}
    assert graph["shard_planner.sub.leaf"] == {"shard_planner.top", "shard_planner.sub"}
    assert graph["shard_planner.top"] == {"shard_planner.sub.leaf"}
    assert set(find_cycles(graph)) == {frozenset({"shard_planner.sub", "shard_planner.sub.leaf", "shard_planner.top"})}


def test_no_import_cycles():
    cycles = find_cycles(import_graph(module_names()))
    unexpected = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"


def test_only_the_cli_imports_the_cli():
    graph = import_graph(module_names())
    offenders = {m: sorted(t for t in targets if t == "shard_planner.cli" or t.startswith("shard_planner.cli."))
                 for m, targets in graph.items()
                 if not (m == "shard_planner.cli" or m.startswith("shard_planner.cli."))}
    assert not {m: t for m, t in offenders.items() if t}


@pytest.mark.parametrize("name", sorted(module_names()))
def test_every_module_imports(name):
    importlib.import_module(name)
