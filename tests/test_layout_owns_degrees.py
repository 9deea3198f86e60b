"""The parallel layout (shard_planner/parallel/mesh.py ``Mesh``) owns the degrees: no other module of the package
multiplies, divides or takes the remainder of a raw degree, and no other dataclass stores one (issue 37
item 2; torchtitan's ``ParallelDims``: "nothing else multiplies degrees by hand").

A raw degree is the layout's own fields read off an object (``.shard``, ``.replicate``, ``.tp``, ``.pp``,
``.tp_size``, a measurement's ``.mesh_*``) or a local named as one (``tp``, ``tp_size``, ``pp``,
``degree``). What the layout derives for a purpose
(``dp_size``, ``world_size``, ``shard_group_size``, ``replicate_group_size``) is the size to use, and may be
multiplied or divided by: ``micro_batch * mesh.dp_size`` is a batch and ``nbytes / mesh.shard_group_size`` a
shard (parallel/mesh.py [Note: which size means what]), not a layout. A stored degree is a
field annotated in a class body under one of those names (or ``degree``).

The search is the AST of every module of shard_planner/ but parallel/mesh.py, so a comment or a string that
mentions ``tp * shard`` is not a hit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import shard_planner

PACKAGE_DIR = Path(shard_planner.__file__).resolve().parent
LAYOUT_MODULE = PACKAGE_DIR / "parallel" / "mesh.py"

DEGREE_ATTRIBUTES = frozenset({"shard", "replicate", "tp", "pp", "tp_size",
                               "mesh_shard", "mesh_replicate", "mesh_tp"})
DEGREE_NAMES = frozenset({"tp", "tp_size", "pp", "degree"})
STORED_DEGREE_NAMES = DEGREE_ATTRIBUTES | DEGREE_NAMES | {"degree"}
ARITHMETIC = (ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)

# Arithmetic allowed outside the layout, each with why: a module (its path relative to shard_planner/) or
# one site in it ("path: source" as ast.unparse writes it).
ALLOWED_ARITHMETIC: dict[str, str] = {
    # Tracing one tensor-parallel rank emulates DTensor's split of a tensor dimension over the tp ranks
    # (trace/tp_local.py [Note: A tensor-parallel rank traced locally]): shape arithmetic of the traced
    # tensors, at the degree the trace is made at, before any layout exists (the trace is one rank's
    # numbers, reused by every layout with that degree).
    "trace/tp_local.py": "the traced tensors' local shapes at the trace's degree",
}

# "Class.field: why" for each degree stored outside the layout.
ALLOWED_STORED: dict[str, str] = {
    # A trace is one rank's numbers at one tensor-parallel degree: the degree is a fact of the data (as its
    # dtype), checked against the plan's layout where both meet (cost/api.py, report). The planner builds
    # its layouts from it (Mesh.fsdp / Mesh.per_node_hsdp); see parallel/mesh.py's docstring.
    "ModelTrace.tp_size": "the degree a trace was made at",
    # A measurement file records the layout its run ran with under these names (its JSON form, as before the
    # layout type); Measurement.mesh reads them back as the layout, whose sizes callers use.
    "Measurement.mesh_shard": "a run's recorded layout (measurement.json)",
    "Measurement.mesh_replicate": "a run's recorded layout (measurement.json)",
    "Measurement.mesh_tp": "a run's recorded layout (measurement.json)",
}


def _modules() -> list[Path]:
    return [p for p in sorted(PACKAGE_DIR.rglob("*.py")) if p != LAYOUT_MODULE]


def _is_degree(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in DEGREE_ATTRIBUTES
    return isinstance(node, ast.Name) and node.id in DEGREE_NAMES


def _arithmetic_sites(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of each ``a op b`` / ``a op= b`` whose operand is a raw degree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ARITHMETIC):
            operands = (node.left, node.right)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ARITHMETIC):
            operands = (node.target, node.value)
        else:
            continue
        if any(_is_degree(o) for o in operands):
            out.append((node.lineno, ast.unparse(node)))
    return out


def _stored_degrees(tree: ast.AST) -> list[str]:
    """``Class.field`` for each annotated class field named as a degree."""
    return [f"{cls.name}.{stmt.target.id}"
            for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
            for stmt in cls.body
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            and stmt.target.id in STORED_DEGREE_NAMES]


def test_no_degree_arithmetic_outside_the_layout():
    hits, allowed_seen = [], set()
    for path in _modules():
        rel = path.relative_to(PACKAGE_DIR).as_posix()
        for line, text in _arithmetic_sites(ast.parse(path.read_text())):
            allowed = next((key for key in (rel, f"{rel}: {text}") if key in ALLOWED_ARITHMETIC), None)
            if allowed is None:
                hits.append(f"{rel}:{line}: {text}")
            allowed_seen.add(allowed)
    assert not hits, ("raw degree arithmetic outside shard_planner/parallel/mesh.py: ask the layout (Mesh) for the size "
                      "or placement instead:\n" + "\n".join(hits))
    stale = sorted(set(ALLOWED_ARITHMETIC) - allowed_seen)
    assert not stale, f"allow-list entries that no longer match any arithmetic: {stale}"


def test_no_stored_degree_outside_the_layout():
    found = [name for path in _modules() for name in _stored_degrees(ast.parse(path.read_text()))]
    extra = sorted(set(found) - set(ALLOWED_STORED))
    assert not extra, f"degrees stored outside the layout (shard_planner/parallel/mesh.py): {extra}"
    stale = sorted(set(ALLOWED_STORED) - set(found))
    assert not stale, f"allow-list entries that no longer match a field: {stale}"


def test_the_search_finds_what_it_forbids():
    """The scanner sees the forms it is meant to: a false negative would make the tests above vacuous."""
    tree = ast.parse("a = m.shard * m.tp\nb = gpus // tp\nc = n / x.tp_size\nd = k % tp\ne = mb * m.dp_size\n"
                     "class C:\n    tp_size: int = 1\n    other: int = 2\n")
    assert [line for line, _ in _arithmetic_sites(tree)] == [1, 2, 3, 4]
    assert _stored_degrees(tree) == ["C.tp_size"]
