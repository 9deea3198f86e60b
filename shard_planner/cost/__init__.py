"""The cost model: per-rank peak memory and step time of an FSDP2 plan.

One object per (trace, profile) owns everything that can be reused between plans
(shard_planner/cost/model.py):

    from shard_planner.cost import CostModel
    model = CostModel(trace, profile)            # cheap; tables etc. are built on first use
    model.estimate(plan, timeline=True) -> Estimate          # memory + time; .prediction() for the plan file
    model.memory(plan, timeline=True) -> MemoryEstimate      # peak, breakdown at the peak, timeline
    model.time(plan) -> TimeEstimate                          # step time, overlap, throughput, MFU
    model.module_compute_s(fqn, micro_batch, numerics) -> (fwd_s, bwd_s)   # fqn None: the loss
    model.subtree_sum(fqn, attr) -> Affine                    # e.g. attr "fwd_flops_self"
    model.tables(units) -> CostTables                         # per segmentation (cost/tables.py)
    model.schedule(units, prefetch) -> Schedule               # the step as events (FSDP2's: cost/schedule.py)
    model.block_compute_s(tables, micro_batch, numerics)   # THE per-block compute time (cost/time.py)

Estimates are memoised by the plan's decisions (units, prefetch, mesh, training): evaluating a cover
twice costs a dict lookup. ``timeline=False`` skips building the memory timeline (the solver's
checks need only the peak). Results are shared between callers: treat them as read-only. The
timings' fingerprint and dtype check (``profile.module_timings``) runs once per compute dtype. ``numerics``:
the plan's dtypes, ``plan.training.numerics`` (plan/numerics.py).

Both simulators walk one event sequence (cost/schedule.py): the memory one tracks live bytes by
category (cost/memory.py), the time one a compute and a communication stream (cost/time.py). Those, the
units' bytes and costs are the plan's engine's rules, asked through the engine seam (cost/engines/
[Note: What an engine owns]; FSDP2's are the modules named here).

The functions below (cost/api.py) are thin wrappers that build a CostModel per call, for callers that
evaluate a few plans (code that judges many holds one CostModel):

    estimate(trace, plan, profile, timeline=True) -> Estimate
    simulate_memory(trace, plan, profile, timeline=True) -> MemoryEstimate
    simulate_time(trace, plan, profile) -> TimeEstimate
    module_compute_s(trace, fqn, micro_batch, profile, numerics) -> (fwd_s, bwd_s)
    cost_tables(trace, units) -> CostTables;  model_state_bytes(trace, plan) -> dict
    plan_unit_bytes(tables, plan) -> tuple[UnitBytes, ...]     # every unit's buffers, by the plan's engine
    tp_collectives_per_step(trace, plan) -> tensor-parallel collectives per step (what ``run`` compares)

~1 ms per plan for an 80-layer model without the memo (benchmarks/bench_cost.py).
"""

from __future__ import annotations

from shard_planner.cost.api import (
    cost_tables, estimate, model_state_bytes, module_compute_s, simulate_memory, simulate_time,
    plan_unit_bytes, tp_collectives_per_step,
)
from shard_planner.cost.model import CostModel
from shard_planner.cost.schedule import Event, EventKind, Schedule, build_schedule
from shard_planner.cost.tables import CostTables
from shard_planner.cost.types import Estimate, MemoryEstimate, MemoryEvent, TimeEstimate, UnitTime
from shard_planner.cost.unit_bytes import UnitBytes


__all__ = [
    "CostModel", "CostTables", "Estimate", "Event", "EventKind", "MemoryEstimate", "MemoryEvent", "Schedule",
    "TimeEstimate", "UnitBytes", "UnitTime", "build_schedule", "cost_tables", "estimate", "model_state_bytes",
    "module_compute_s", "plan_unit_bytes", "simulate_memory", "simulate_time", "tp_collectives_per_step",
]
