"""Tier 1: the budget the planner's search fills is ``profile.tensor_budget_bytes(--mem)``: --mem (at most
the device's memory) x the profile's usable_fraction, on the hand-written stack of
tests/models/solve_traces.py with its profile at usable_fraction 0.9. The search alone: the requests turn
the caching-allocator check of the answer off (``allocator_check``; tests/solve/test_survive.py tests it),
since these stacks are measured in MiB, where the allocator's 2-20 MiB pages would decide.

- a plan's simulated peak stays within 90% of --mem, where the same --mem with nothing kept free
  gives a plan above it (the solver fills what it is given);
- --mem above the device's memory is capped by the device;
- an infeasible budget names both numbers, and the --mem it says is the smallest needed does fit.
"""

from dataclasses import replace

import pytest

from tests.models.solve_traces import GIB, MIB, profile, stack_trace
from shard_planner.errors import InfeasibleError
from shard_planner.solve import PlanRequest, plan_model
from shard_planner.solve.simulate import simulate
from shard_planner.units import parse_bytes

KEEP_FREE = replace(profile(), usable_fraction=0.9)
FILL_ALL = profile()  # usable_fraction 1.0


def _plan(trace, mem_bytes, prof, **kw):
    return plan_model(trace, PlanRequest(gpus=8, mem_budget_bytes=mem_bytes, profile=prof, gpus_per_node=8, micro_batch=4,
                      frontier_points=3, time_limit_s=2.0, allow_offload=False, allocator_check=False, **kw)).plan


@pytest.fixture(scope="module")
def trace8():
    return stack_trace(8)


def test_fragmentation_share_of_mem_stays_free(trace8):
    mem = 1900 * MIB
    usable = KEEP_FREE.tensor_budget_bytes(mem)
    assert usable == int(mem * 0.9)
    filled = _plan(trace8, mem, FILL_ALL)
    assert filled.predicted.peak_bytes > usable  # the premise: given all of --mem, the solver uses more than 90%
    kept = _plan(trace8, mem, KEEP_FREE)
    assert simulate(trace8, replace(kept, predicted=None), KEEP_FREE).memory.peak_bytes \
        == kept.predicted.peak_bytes <= usable
    assert kept.cluster.mem_budget_bytes == mem  # the plan records --mem, as given
    assert all(p.fits == (p.peak_bytes <= usable) for p in kept.frontier)


def test_mem_above_the_device_is_capped_by_it(trace8):
    small_device = replace(KEEP_FREE, memory_bytes=2 * GIB)
    assert small_device.tensor_budget_bytes(64 * GIB) == int(2 * GIB * 0.9)
    plan = _plan(trace8, 64 * GIB, small_device)
    assert plan.predicted.peak_bytes <= int(2 * GIB * 0.9)


def test_infeasible_names_both_numbers_and_a_mem_that_fits(trace8):
    with pytest.raises(InfeasibleError) as info:
        _plan(trace8, 600 * MIB, KEEP_FREE)
    msg = str(info.value)
    assert msg.startswith("no plan fits 600.00 MiB per GPU (540.00 MiB of allocated peak at most: --mem 600.00 MiB "
                          "less the 10% margin of the allocator simulation, profile test-gpu); the smallest budget "
                          "any plan needs is "), msg
    need = parse_bytes(msg.split("needs is ")[1].split(" (")[0])
    peak = parse_bytes(msg.split("(peak ")[1].split(";")[0])
    # in --mem terms, the margin on top (each figure rounded to 0.005 GiB in the message)
    assert need == pytest.approx(peak / 0.9, abs=12 * MIB)
    plan = _plan(trace8, need + 8 * MIB, KEEP_FREE)  # + the rounding of the message's 2 decimals
    assert plan.predicted.peak_bytes <= KEEP_FREE.tensor_budget_bytes(need + 8 * MIB)
