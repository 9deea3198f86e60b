"""The module graph the solver walks, built from a trace (never stored in it)."""

from __future__ import annotations

import networkx as nx

from shard_planner.trace.types import ModelTrace


def graph(trace: ModelTrace) -> nx.DiGraph:
    """A directed graph of the trace's modules.

    Nodes: every module's fqn (the root is ``""``), with attribute ``module`` = its
    :class:`~shard_planner.trace.types.ModuleTrace`.

    Edges, each with attribute ``kind``:

    - ``"child"``: parent -> child, for the module tree (so ``nx.descendants(g, fqn)`` restricted to
      child edges is the subtree);
    - ``"forward_next"``: ``forward_order[i] -> forward_order[i + 1]``, the execution order of forward;
    - ``"backward_next"``: ``backward_order[i] -> backward_order[i + 1]``, likewise for backward.

    A pair of modules linked in more than one way (a parent entered right before its first child) keeps
    one edge per pair in a DiGraph, so edges of the three kinds are stored as a set in ``kinds`` as well;
    ``kind`` holds the first that was added (child, then forward_next, then backward_next). Use
    :func:`edges_of_kind` to select one kind.
    """
    g = nx.DiGraph(model_class=trace.model_class, fingerprint=trace.fingerprint)
    for m in trace.modules:
        g.add_node(m.fqn, module=m)
    for m in trace.modules:
        for child in m.children:
            _add(g, m.fqn, child, "child")
    for kind, order in (("forward_next", trace.forward_order), ("backward_next", trace.backward_order)):
        for a, b in zip(order, order[1:]):
            _add(g, a, b, kind)
    return g


def _add(g: nx.DiGraph, a: str, b: str, kind: str) -> None:
    if g.has_edge(a, b):
        g.edges[a, b]["kinds"].add(kind)
    else:
        g.add_edge(a, b, kind=kind, kinds={kind})


def edges_of_kind(g: nx.DiGraph, kind: str) -> list[tuple[str, str]]:
    """The edges (a, b) that carry ``kind`` ("child", "forward_next" or "backward_next")."""
    return [(a, b) for a, b, kinds in g.edges(data="kinds") if kind in kinds]
