"""The package's layering: its folders are floors, each importing only floors below it; no import cycle
between its modules; only shard_planner.cli imports the CLI; the top level holds the package's face and its
leaves only (docs/extending.md, "The floors").

The graph has an edge A -> B for every ``import`` statement in module A (at any depth, so an import
inside a function counts too) that names module B of the package (``from pkg import name`` names
``pkg.name`` where that is a module, else ``pkg``). For the floors, imports under ``if TYPE_CHECKING:`` do
not count: they name a type for an annotation and run nothing (a recipe's annotation names the solver's
search space, which the solver builds the recipes from).
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


# The floors, lowest first: a folder of shard_planner/ (a package) imports only packages of lower floors (and
# itself); "leaf" is the top level's modules besides the face (shard_planner/__init__.py). Two folders on one
# floor import neither from the other.
FLOORS: tuple[frozenset[str], ...] = tuple(frozenset(f.split()) for f in (
    "leaf face",  # errors, units, dtypes, fileio, argtypes, process, progress; the version
    "parallel",  # the layout (parallel/mesh.py) and a plan's tensor-parallel split: vocabulary
    "plan",  # the plan file's vocabulary: the plan, its schema, points, prediction, recipes, measurement
    "model",  # a user's model file or transformers config, loaded; LoRA/QLoRA applied
    "trace",  # one rank's trace of the model (tensor-parallel styles and degrees derived here)
    "hardware load",  # device profiles, allocator mode, module timings; a plan read back and its model rebuilt
    "cost",  # the memory and time model
    "solve",  # the search
    "execute report",  # FSDP2 runs of a plan; the report and the exports
    "tune",  # the measured loop
    "cli",
))
LEAVES = frozenset({"argtypes", "dtypes", "errors", "fileio", "process", "progress", "units"})


def import_graph(modules: dict[str, Path], *, runtime_only: bool = False) -> dict[str, set[str]]:
    """module -> the package modules its import statements name (``runtime_only``: not those under ``if
    TYPE_CHECKING:``)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        tree = ast.parse(path.read_text(), str(path))
        skipped = {id(n) for block in ast.walk(tree) if runtime_only and _type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
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


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def folder_of(module: str, modules: dict[str, Path]) -> str:
    """The floor name of ``module``: its folder under shard_planner/, "leaf" for a top-level module, "face" for
    the package itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return "face"
    if len(parts) == 2 and modules[module].name != "__init__.py":
        return "leaf"
    return parts[1]


def floor_of(folder: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if folder in names)


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


def test_every_folder_has_a_floor_and_the_top_level_holds_leaves_only():
    modules = module_names()
    folders = {folder_of(m, modules) for m in modules}
    assert folders - {"leaf"} == set().union(*FLOORS) - {"leaf"}, "a folder without a floor, or a floor without one"
    top = {m.split(".")[1] for m in modules if folder_of(m, modules) == "leaf"}
    assert top == LEAVES, f"top-level modules that are not leaves: {sorted(top - LEAVES)} (docs/extending.md)"


def test_no_upward_import():
    modules = module_names()
    graph = import_graph(modules, runtime_only=True)
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if folder_of(m, modules) != folder_of(t, modules)
                    and floor_of(folder_of(t, modules)) >= floor_of(folder_of(m, modules)))
    assert not upward, "imports of the same or a higher floor (tests/test_layering.py FLOORS): " + "; ".join(upward)


def test_the_floor_check_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "shard_planner"
    for sub in ("plan", "cost"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "a.py").write_text("from shard_planner.cost import b\n")
    (pkg / "cost" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shard_planner.plan import a\n")
    modules = {"shard_planner": pkg / "__init__.py", "shard_planner.plan": pkg / "plan" / "__init__.py",
               "shard_planner.cost": pkg / "cost" / "__init__.py", "shard_planner.plan.a": pkg / "plan" / "a.py",
               "shard_planner.cost.b": pkg / "cost" / "b.py"}
    graph = import_graph(modules, runtime_only=True)
    assert graph["shard_planner.plan.a"] == {"shard_planner.cost.b"} and graph["shard_planner.cost.b"] == set()
    assert floor_of(folder_of("shard_planner.cost.b", modules)) > floor_of(folder_of("shard_planner.plan.a", modules))


def test_only_the_cli_imports_the_cli():
    graph = import_graph(module_names())
    offenders = {m: sorted(t for t in targets if t == "shard_planner.cli" or t.startswith("shard_planner.cli."))
                 for m, targets in graph.items()
                 if not (m == "shard_planner.cli" or m.startswith("shard_planner.cli."))}
    assert not {m: t for m, t in offenders.items() if t}


@pytest.mark.parametrize("name", sorted(module_names()))
def test_every_module_imports(name):
    importlib.import_module(name)
