"""FSDP2's engine: PyTorch's ``fully_shard`` (torch 2.13, torch/distributed/fsdp/_fully_shard/), its rules
as the cost model has always priced them, behind the engine seam (cost/engines/__init__.py [Note: What an
engine owns]).

Each method calls its rule through the rule's module at call time, not a name bound at import, so that a
test that patches a rule's function in its module patches every caller:

    schedule                 cost/schedule.py ``build_schedule``: FSDP2's step as events (pre-forward,
                             all-gather and its wait, reshard, post-backward's reduce-scatter, ...)
    unit_bytes               cost/unit_bytes.py ``query_unit_bytes``: sharded state, all-gather output,
                             unsharded parameters, reduce-scatter buffers (cost/fsdp2_rules.py's padding)
    unit_cost                cost/unit_cost.py ``unit_cost``: bytes, collectives, copies, optimizer state
    memory_walk              cost/memory.py ``simulate_memory_walk``
    accumulated_memory_walk  cost/accumulation.py ``simulate_accumulated_memory``
    time_inputs              cost/time.py ``unit_collectives_s`` and ``unit_copies_s``: per unit its
                             all-gathers', reduce-scatter's and copies' seconds
    time_walk                cost/time.py ``simulate_time_walk``
    accumulated_time         cost/accumulation.py ``accumulated_time``: which collectives each micro-step
                             runs (gathered parameters kept, gradient sync on the last micro-step)
"""

from __future__ import annotations

from shard_planner.cost import accumulation as _accumulation
from shard_planner.cost import memory as _memory
from shard_planner.cost import schedule as _schedule
from shard_planner.cost import time as _time
from shard_planner.cost import unit_bytes as _unit_bytes
from shard_planner.cost import unit_cost as _unit_cost
from shard_planner.plan.engine import FSDP2


class _FSDP2Engine:
    """See the module docstring."""

    name = FSDP2

    def schedule(self, t, units, prefetch):
        return _schedule.build_schedule(t, units, prefetch)

    def unit_bytes(self, t, q):
        return _unit_bytes.query_unit_bytes(t, q)

    def unit_cost(self, params, reshard_after_forward, setting, profile):
        return _unit_cost.unit_cost(params, reshard_after_forward, setting, profile)

    def memory_walk(self, trace, t, plan, profile, ub, sched, acts, *, timeline, selective, accountants):
        return _memory.simulate_memory_walk(trace, t, plan, profile, ub, sched, acts, timeline=timeline,
                                           selective=selective, accountants=accountants)

    def accumulated_memory_walk(self, trace, t, plan, profile, ub, sched, acts, *, timeline, selective,
                                accountants):
        return _accumulation.simulate_accumulated_memory(trace, t, plan, profile, ub, sched, acts, timeline=timeline,
                                                        selective=selective, accountants=accountants)

    def time_inputs(self, costs):
        return _time.unit_collectives_s(costs), _time.unit_copies_s(costs)

    def time_walk(self, trace, t, plan, profile, sched, compute, collectives, *, selective, copies):
        return _time.simulate_time_walk(trace, t, plan, profile, sched, compute, collectives, selective=selective,
                                       copies=copies)

    def accumulated_time(self, training, walk, collectives, tokens_per_sample, dp_size):
        return _accumulation.accumulated_time(training, walk, collectives, tokens_per_sample, dp_size)


FSDP2_ENGINE = _FSDP2Engine()
