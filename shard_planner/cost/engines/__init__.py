"""The engine seam: the rules of the library that shards a plan, behind one interface the cost model asks.

    engine = engine_named(plan.engine)              # FSDP2_ENGINE for "fsdp2"
    engine.schedule(tables, units, prefetch)        # the step's events, which both simulators walk
    engine.unit_bytes(tables, q)                    # every unit's buffers (cost/unit_bytes.py's UnitBytes)
    engine.unit_cost(params, reshard, setting, profile)   # one unit's bytes, collectives, copies, state
    engine.memory_walk(...) / engine.accumulated_memory_walk(...)   # one step; several micro-steps
    engine.time_inputs(costs) / engine.time_walk(...) / engine.accumulated_time(...)

[Note: What an engine owns]
The cost model has two kinds of knowledge. What the model computes is no engine's business:
each module's FLOPs and kernels, activations and what checkpointing keeps, the tensor-parallel collectives
(cost/kernels.py, cost/activations.py, cost/selective.py, cost/tp_comm.py), the caching allocator's
reserved memory over whatever the walk allocates (cost/reserved.py and the allocator modules), and the
prediction's format (cost/types.py). How the model's state is sharded, gathered, reduced and freed is the
engine's: the order of its events in a step, each unit's buffers and collectives, where the optimizer's
state lives, the walks that allocate and time them, and what each micro-step of gradient accumulation
runs. CostModel (cost/model.py) asks the plan's engine
for the second kind and keeps its memos keyed by queries that name the engine (cost/queries.py), so two
engines' answers for the same decisions never share a memo.

FSDP2's engine (cost/engines/fsdp2.py) is the modules it always was (cost/schedule.py, cost/unit_bytes.py,
cost/unit_cost.py, cost/memory.py, cost/accumulation.py, cost/time.py), called through their modules. A
second engine (DeepSpeed ZeRO) is one more :class:`Engine` here: its own schedule (ZeRO-3's per-module
fetch and release, ZeRO-1/2's replicated parameters and bucketed reduce-scatter), its own unit bytes and
collectives, and its own walks (subclasses of FSDP2's where the step has the same shape), registered in
``_engines()`` under the name plan/engine.py lists. The solver asks the engine too for each candidate
unit's cost (solve/candidate_costs.py); its search space (reshard after forward, prefetch depths) and its
linear model's structure are FSDP2's decisions, so a second engine with other knobs (ZeRO's stage and
buckets) brings them to solve/space.py (docs/extending.md, "DeepSpeed ZeRO 1-3 as a second engine").
"""

from __future__ import annotations

import functools
from typing import Protocol

from shard_planner.errors import PlanError
from shard_planner.plan.engine import ENGINES as ENGINE_NAMES


class Engine(Protocol):
    """A sharding engine's rules, as the cost model asks them ([Note: What an engine owns])."""

    name: str  # the plan's ``engine`` (plan/engine.py ENGINES)

    def schedule(self, t, units, prefetch):
        """The step's events (cost/schedule.py ``Schedule``) for ``units`` and ``prefetch``."""

    def unit_bytes(self, t, q):
        """Every unit's buffers (a tuple of cost/unit_bytes.py ``UnitBytes``) for a ``UnitBytesQuery``."""

    def unit_cost(self, params, reshard_after_forward, setting, profile):
        """One unit's cost (cost/unit_cost.py ``UnitCost``) under a ``UnitSetting`` on ``profile``."""

    def memory_walk(self, trace, t, plan, profile, ub, schedule, acts, *, timeline, selective, accountants):
        """One step's memory walk (cost/types.py ``MemoryEstimate``)."""

    def accumulated_memory_walk(self, trace, t, plan, profile, ub, schedule, acts, *, timeline, selective,
                                accountants):
        """The memory walk of an optimizer step of several micro-steps."""

    def time_inputs(self, costs):
        """From every unit's cost, per unit its collectives' and its copies' seconds: the time walk's inputs."""

    def time_walk(self, trace, t, plan, profile, schedule, compute, collectives, *, selective, copies):
        """One step's two-stream time walk (cost/types.py ``TimeEstimate``)."""

    def accumulated_time(self, training, walk, collectives, tokens_per_sample, dp_size):
        """An optimizer step of several micro-steps, each timed by ``walk`` with the collectives it runs."""


@functools.cache
def _engines() -> dict[str, Engine]:
    """Every engine by name, built once (imported here, not at the top: an engine imports the cost package,
    whose face imports cost/model.py, which imports this module)."""
    from shard_planner.cost.engines.fsdp2 import FSDP2_ENGINE
    from shard_planner.cost.engines.single import SINGLE_ENGINE

    return {e.name: e for e in (FSDP2_ENGINE, SINGLE_ENGINE)}


def engine_named(name: str) -> Engine:
    """The engine a plan names (plan/engine.py ``ENGINES``); a PlanError naming the ones there are."""
    engine = _engines().get(name)
    if engine is None:
        raise PlanError(f"engine {name!r} is not one of {', '.join(ENGINE_NAMES)}")
    return engine
