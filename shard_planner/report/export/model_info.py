"""What the exporters need to know about the model: module classes and parameter counts per unit.

From a trace when there is one (``ModuleTrace.type_name``, ``param_count``); otherwise the model file is
imported and the model built on the meta device (no memory, seconds even for 70B shapes) and checked
against the plan's fingerprint, so a size mismatch (``SHARD_PLANNER_SIZE``) is caught, not exported.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.plan import Plan
from shard_planner.report.rows import unit_owners
from shard_planner.trace.types import ModelTrace


@dataclass(frozen=True)
class ModuleInfo:
    fqn: str
    type_name: str
    parent: str | None
    param_count: int  # parameters registered on this module itself (tied weights counted once)
    # the element count of each of those parameter tensors; None when unknown (a trace records only
    # the module's total and its tensor count, so a module with several tensors is unknown from a trace)
    param_numels: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ModelInfo:
    modules: tuple[ModuleInfo, ...]  # named_modules() order, root first

    def type_of(self, fqn: str) -> str:
        return next(m.type_name for m in self.modules if m.fqn == fqn)

    def unit_owners(self, plan: Plan) -> dict[str, int]:
        """Module -> index of the unit of ``plan`` that owns its parameters (innermost; the root the rest)."""
        return unit_owners(plan, (m.fqn for m in self.modules))

    def unit_param_counts(self, plan: Plan) -> list[int]:
        """Parameters each unit of ``plan`` owns (innermost unit; the root owns the rest)."""
        owners = self.unit_owners(plan)
        counts = [0] * len(plan.units)
        for m in self.modules:
            counts[owners[m.fqn]] += m.param_count
        return counts


def model_info_from_trace(trace: ModelTrace) -> ModelInfo:
    def numels(m) -> tuple[int, ...] | None:
        if m.param_count == 0:
            return ()
        return (m.param_count,) if m.param_tensors == 1 else None

    return ModelInfo(tuple(ModuleInfo(m.fqn, m.type_name, m.parent, m.param_count, numels(m)) for m in trace.modules))


def model_info_from_model(model) -> ModelInfo:
    seen: set[int] = set()
    out = []
    for fqn, module in model.named_modules():
        numels = []
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                numels.append(p.numel())
        parent = None if fqn == "" else fqn.rpartition(".")[0]
        out.append(ModuleInfo(fqn, type(module).__name__, parent, sum(numels), tuple(numels)))
    return ModelInfo(tuple(out))


def model_info_for_plan(plan: Plan) -> ModelInfo:
    """Build the plan's model on the meta device and check it is the model the plan was made for (the line every
    command says: shard_planner/load/checked_plan.py, [Note: A plan checked against its model])."""
    from shard_planner.load.checked_plan import check_fingerprint, plan_model
    from shard_planner.trace.structure import model_fingerprint

    model = plan_model(plan.model)
    check_fingerprint(plan, model_fingerprint(model), plan.model.path)
    return model_info_from_model(model)
