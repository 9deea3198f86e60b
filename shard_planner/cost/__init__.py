"""The cost model: per-rank peak memory and step time of an FSDP2 plan, as pure functions.

    from shard_planner.cost import simulate_memory, simulate_time, estimate
    simulate_memory(trace, plan, profile) -> MemoryEstimate   # peak, breakdown, timeline
    simulate_time(trace, plan, profile) -> TimeEstimate       # step time, overlap, throughput, MFU
    estimate(trace, plan, profile) -> Estimate                # both; .prediction() for the plan file

Tables that depend only on the trace and the segmentation into units are built once and cached
(shard_planner/cost/tables.py), so the solver can evaluate thousands of plans: ~1 ms each for an
80-layer model (benchmarks/bench_cost.py).
"""

from __future__ import annotations

from shard_planner.cost.memory import UnitBytes, model_state_bytes, simulate_memory, unit_bytes
from shard_planner.cost.tables import CostTables, cost_tables
from shard_planner.cost.time import module_compute_s, simulate_time
from shard_planner.cost.types import Estimate, MemoryEstimate, MemoryEvent, TimeEstimate, UnitTime
from shard_planner.plan import Plan
from shard_planner.profile import HardwareProfile
from shard_planner.trace.types import ModelTrace


def estimate(trace: ModelTrace, plan: Plan, profile: HardwareProfile, *, timeline: bool = True) -> Estimate:
    """Memory and time of ``plan`` for ``trace`` on ``profile``; ``.prediction()`` gives the plan's
    ``predicted`` section. ``timeline=False`` skips the memory timeline (faster; the solver's case).
    The per-unit byte table both simulators read is built once."""
    ub = unit_bytes(cost_tables(trace, plan.units), plan)
    return Estimate(memory=simulate_memory(trace, plan, profile, timeline=timeline, ub=ub),
                    time=simulate_time(trace, plan, profile, ub=ub))


__all__ = [
    "CostTables", "Estimate", "UnitBytes", "MemoryEstimate", "MemoryEvent", "TimeEstimate", "UnitTime",
    "cost_tables", "estimate", "model_state_bytes", "module_compute_s", "simulate_memory", "simulate_time",
    "unit_bytes",
]
