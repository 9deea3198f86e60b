"""The search space's items' parameters as the units made of them would own them (cost/unit_params.py).

The solver's linear model prices a candidate unit (a run of items with one option, solve/space.py) by
the per-unit cost query of the simulators (cost/unit_cost.py), so it needs the candidate's parameters in
the form the simulators' cost tables give a unit: by built dtype, floating apart from the rest, 0-d ones
apart. A candidate unit owns its items' whole subtrees; a nested one is one unit for the item's own
parameters (its subtree less the nested children's) and one per nested child; the root unit owns what no
item does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from operator import add

from shard_planner.cost.unit_params import UnitParams
from shard_planner.solve.space import Candidate, SearchSpace
from shard_planner.trace.types import ModelTrace


@dataclass(frozen=True)
class ItemParams:
    """Per item of a search space: its subtree's parameters, and where it may be nested, its own
    (``outer``, the nested children's subtrees left out) and each nested child's (``nested``)."""

    whole: tuple[UnitParams, ...]
    outer: tuple[UnitParams | None, ...]  # None: the item cannot be nested
    nested: tuple[tuple[UnitParams, ...], ...]

    def parts(self, c: Candidate) -> tuple[UnitParams, ...]:
        """The parameters of each FSDP unit candidate ``c`` makes, the outer one first: one unit of all
        its items, or (nested) the item's own and one per nested child."""
        if c.option.nested:
            return (self.outer[c.start], *self.nested[c.start])
        return (reduce(add, self.whole[c.start:c.stop]),)


def item_params(trace: ModelTrace, space: SearchSpace) -> ItemParams:
    """The parameters of every item of ``space`` (the module docstring)."""
    whole, outer, nested = [], [], []
    for it in space.items:
        whole.append(UnitParams.of_modules(trace.subtree(it.fqn)))
        if it.nested_children:
            below = {m.fqn for k in it.nested_children for m in trace.subtree(k)}
            outer.append(UnitParams.of_modules(m for m in trace.subtree(it.fqn) if m.fqn not in below))
            nested.append(tuple(UnitParams.of_modules(trace.subtree(k)) for k in it.nested_children))
        else:
            outer.append(None)
            nested.append(())
    return ItemParams(tuple(whole), tuple(outer), tuple(nested))


def root_only_params(trace: ModelTrace, space: SearchSpace) -> UnitParams:
    """The parameters no item owns: the root's own, expanded containers' own, modules that never run
    (``SearchSpace.root_only_params`` counts their elements)."""
    owned = {m.fqn for it in space.items for m in trace.subtree(it.fqn)}
    return UnitParams.of_modules(m for m in trace.modules if m.fqn not in owned)
