"""Thin function wrappers over :class:`~shard_planner.cost.model.CostModel` for callers that evaluate a
few plans: each call builds a CostModel of its own (no module-level cache; some 10 ms a plan for a
Llama 8B trace). Code that judges many plans of one trace holds one CostModel instead. Here, not
beside the simulators, so that cost/model.py imports the simulators and nothing in the package
imports back (tests/test_layering.py)."""

from __future__ import annotations

from shard_planner.plan.checkpointing import check_checkpointing_allowed
from shard_planner.plan.comm import TP, GroupCollectiveBytes
from shard_planner.cost.model import CostModel
from shard_planner.cost import optimizer as optimizer_rules
from shard_planner.cost.engines import engine_named
from shard_planner.cost.queries import UnitBytesQuery
from shard_planner.cost.tables import CostTables, build_tables
from shard_planner.cost.tp_comm import TP_GROUP, tp_bytes_per_step
from shard_planner.cost.types import Estimate, MemoryEstimate, TimeEstimate
from shard_planner.cost.unit_bytes import UnitBytes
from shard_planner.errors import PlanError
from shard_planner.plan import Plan, Unit
from shard_planner.plan.numerics import Numerics
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.trace.types import ModelTrace


def estimate(trace: ModelTrace, plan: Plan, profile: HardwareProfile, *, timeline: bool = True) -> Estimate:
    """Memory and time of ``plan`` for ``trace`` on ``profile``; ``.prediction()`` gives the plan's
    ``predicted`` section. ``timeline=False`` skips the memory timeline (faster; the solver's case).
    A plan that checkpoints a model whose forward builds a cache is refused (PlanError; see
    [Note: No checkpointing of a forward that builds a cache] in shard_planner/plan/checkpointing.py)."""
    check_checkpointing_allowed(plan.units, trace.model_path, trace.forward_cache)
    check_tp_degree(plan, trace)
    return CostModel(trace, profile).estimate(plan, timeline=timeline)


def check_tp_degree(plan: Plan, trace: ModelTrace) -> None:
    """A trace holds one rank's numbers at the tensor-parallel degree it was traced at: a plan of another
    degree would be priced with the wrong split (PlanError)."""
    if plan.mesh.tp_size != trace.tp_size:
        raise PlanError(f"the plan splits the model over {plan.mesh.tp_size} tensor-parallel ranks but the trace of "
                        f"{trace.model_path} is one rank's at tp {trace.tp_size}: trace it at the plan's degree "
                        f"(shard-planner plan/estimate do)")


def simulate_memory(trace: ModelTrace, plan: Plan, profile: HardwareProfile, *, timeline: bool = True,
                    ub=None) -> MemoryEstimate:
    """Peak live bytes of one rank over one steady-state training step (cost/memory.py). ``ub`` is
    accepted for old callers and ignored (the model memoises the unit bytes)."""
    return CostModel(trace, profile).memory(plan, timeline=timeline)


def simulate_time(trace: ModelTrace, plan: Plan, profile: HardwareProfile, *, ub=None) -> TimeEstimate:
    """Predicted time of one training step on one rank, and what it is made of (cost/time.py)."""
    return CostModel(trace, profile).time(plan)


def module_compute_s(trace: ModelTrace, fqn: str | None, micro_batch: int, profile: HardwareProfile,
                     numerics: Numerics) -> tuple[float, float]:
    """Forward and backward seconds of ``fqn``'s subtree at ``micro_batch`` under ``numerics``, compute only
    (``CostModel.module_compute_s``)."""
    return CostModel(trace, profile).module_compute_s(fqn, micro_batch, numerics)


def cost_tables(trace: ModelTrace, units: tuple[Unit, ...]) -> CostTables:
    """The tables for ``trace`` segmented into ``units`` (``CostModel.tables``)."""
    return build_tables(trace, units)


def model_state_bytes(trace: ModelTrace, plan: Plan) -> dict[str, int]:
    """Sharded parameters, gradients and optimizer states per rank (the ZeRO model state)."""
    ub = plan_unit_bytes(build_tables(trace, plan.units), plan)
    grads = sum(x.sharded_grad for x in ub)
    return {
        "sharded_params": int(round(sum(x.sharded for x in ub))),
        "grads": int(round(grads)),
        "optimizer_states": int(round(optimizer_rules.optimizer_state_bytes(plan.training.optimizer, grads))),
    }


def plan_unit_bytes(t: CostTables, plan: Plan) -> tuple[UnitBytes, ...]:
    """The byte sizes of every unit of ``plan`` (segmented as ``t``), by the plan's engine's rules
    (cost/engines/; FSDP2's: cost/unit_bytes.py ``query_unit_bytes``)."""
    return engine_named(plan.engine).unit_bytes(t, UnitBytesQuery.of(plan))


def tp_collectives_per_step(trace: ModelTrace, plan: Plan) -> tuple[GroupCollectiveBytes, ...]:
    """The tensor-parallel collectives one rank of ``plan`` issues per optimizer step, per kind, over the
    device mesh's tp group, as ``run`` counts DTensor's (execute/comm_count.py): calls and bytes from
    ``trace``, one rank traced at the plan's degree (cost/tp_comm.py ``tp_bytes_per_step``, a checkpointed
    block's forward ones twice); none without tensor parallelism. PlanError when the trace's degree is not
    the plan's."""
    check_tp_degree(plan, trace)
    t = build_tables(trace, plan.units)
    checkpointed = engine_named(plan.engine).schedule(t, plan.units, plan.prefetch).checkpointed
    return tuple(GroupCollectiveBytes(TP, TP_GROUP, c.collective, c.group_size, c.calls, c.bytes)
                 for c in tp_bytes_per_step(plan, trace, t, checkpointed))
