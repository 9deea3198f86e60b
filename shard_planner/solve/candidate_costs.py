"""What every candidate unit of a search space costs under one plan setting: the per-unit query of the
simulators (cost/unit_cost.py) asked once per candidate, for the linear models of every global choice
that shares the setting.

A candidate's FSDP units (one, or nested: the outer and one per nested child; solve/item_params.py)
cost what their parameters, the setting (cost/queries.py ``UnitSetting``: the mesh, the dtypes, the
optimizer, CPU offload) and the profile make them cost: not the micro-batch, the prefetch depths or the
accumulation policy. The planner's global choices differ mostly in those (Llama 3 70B on 256 GPUs: 30
choices over 2 settings), so it prices the candidates once per setting (solve/context.py
``PlanContext.linear``) and each linear model reads the costs from here (solve/linear.py
``build_linear_model``): the same numbers as pricing them per choice, by the same function.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from operator import add

from shard_planner.cost.queries import UnitSetting
from shard_planner.cost.engines import engine_named
from shard_planner.cost.unit_cost import UnitCost
from shard_planner.cost.unit_params import UnitParams
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.solve.item_params import item_params, root_only_params
from shard_planner.solve.space import SearchSpace
from shard_planner.trace.types import ModelTrace


@dataclass(frozen=True, eq=False)
class CandidateCosts:
    """Per candidate of ``space`` (parallel to ``space.candidates``), under ``setting`` on ``profile``: the
    cost of each FSDP unit it makes (``parts``, the outer first) and of all of them as one (``whole``);
    and the whole model's parameters (``model_params``) with their cost as one unit's, resharded
    (``model``), and the cost of the parameters no item owns (``root``, never resharded: FSDP2's root)."""

    space: SearchSpace
    setting: UnitSetting
    profile: HardwareProfile
    parts: tuple[tuple[UnitCost, ...], ...]
    whole: tuple[UnitCost, ...]
    model_params: UnitParams
    model: UnitCost
    root: UnitCost

    def matches(self, space: SearchSpace, setting: UnitSetting, profile: HardwareProfile) -> bool:
        """Whether these are the costs of ``space``'s candidates under ``setting`` on ``profile``."""
        return (self.space is space and self.setting == setting
                and (self.profile is profile or self.profile == profile))  # (a fresh CostModel's for_world: equal)


def candidate_costs(trace: ModelTrace, space: SearchSpace, setting: UnitSetting,
                    profile: HardwareProfile) -> CandidateCosts:
    """Every candidate's unit costs (the module docstring), each by :func:`unit_cost` of its units'
    parameters (solve/item_params.py ``ItemParams.parts``) with the candidate's ``reshard_after_forward``."""
    params = item_params(trace, space)
    priced = engine_named(setting.engine).unit_cost  # the plan's engine's rule (cost/engines/)
    parts, whole = [], []
    for c in space.candidates:
        param_parts = params.parts(c)
        costs = tuple(priced(p, c.option.reshard_after_forward, setting, profile) for p in param_parts)
        parts.append(costs)
        whole.append(costs[0] if len(costs) == 1 else priced(reduce(add, param_parts),
                                                              c.option.reshard_after_forward, setting, profile))
    model_params = UnitParams.of_modules(trace.modules)
    return CandidateCosts(
        space=space, setting=setting, profile=profile, parts=tuple(parts), whole=tuple(whole),
        model_params=model_params, model=priced(model_params, True, setting, profile),
        root=priced(root_only_params(trace, space), None, setting, profile))
