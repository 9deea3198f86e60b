"""FSDP2's copy-out after each all-gather and copy-in before each reduce-scatter on the compute stream
(shard_planner/cost/fsdp_copies.py [Note: FSDP2's copies on the compute stream]) and their place in the
step-time simulation (cost/time.py)."""

import dataclasses

import pytest

from shard_planner.cost import simulate_time
from shard_planner.cost.fsdp_copies import copy_bandwidth_bytes_per_s
from shard_planner.cost.queries import UnitSetting
from shard_planner.cost.tables import build_tables
from shard_planner.cost.time import unit_copies_s
from shard_planner.cost.unit_cost import unit_cost
from shard_planner.hardware.profile import load_profile
from tests.cost.test_cost_model import synth_plan


def _quiet(profile):
    """No framework overhead and no overlap slowdown: the copies' cost is their time alone."""
    return dataclasses.replace(profile, per_op_overhead_s=0.0, per_unit_overhead_s=0.0, overlap_compute_slowdown=0.0)


def _costs(trace, plan, profile):
    """Every unit's cost (cost/unit_cost.py), as the time walk reads them."""
    setting = UnitSetting.of(plan)
    return [unit_cost(p, u.reshard_after_forward, setting, profile)
            for p, u in zip(build_tables(trace, plan.units).unit_params, plan.units)]


def _copies(trace, plan, profile):
    return unit_copies_s(_costs(trace, plan, profile))


def test_copies_move_the_unit_bytes_at_the_achieved_hbm_bandwidth(synth, h100):
    plan = synth_plan(synth, 8, mb=2)
    costs = _costs(synth, plan, h100)
    ub = [c.bytes for c in costs]
    bw = h100.memory_bandwidth_bytes_per_s * h100.kernels["memory_efficiency"]
    assert copy_bandwidth_bytes_per_s(h100) == bw
    out, into = unit_copies_s(costs)
    for x, o, i in zip(ub, out, into):
        # copy-out reads the all-gather output and writes the parameters (param dtype); copy-in reads the
        # gradients (param dtype) and writes the reduce-scatter input (reduce dtype: fp32 here, 2x)
        assert o == pytest.approx(2 * x.unsharded / bw) and i == pytest.approx((x.unsharded + x.rs_input) / bw)
        assert x.rs_input == pytest.approx(2 * x.unsharded)
    assert all(o > 0 for o in out)


def test_cpu_profiles_and_fsdp1_have_no_copies(synth, h100):
    plan = synth_plan(synth, 8, mb=2)
    for profile in (load_profile("cpu-gloo"), dataclasses.replace(h100, fsdp_copies=False)):
        out, into = _copies(synth, plan, profile)
        assert set(out) == {0.0} and set(into) == {0.0}


@pytest.mark.parametrize("reshard", [True, False])
def test_the_copies_add_their_time_less_what_they_hide(synth, h100, reshard):
    """Every unit's forward all-gather, its backward all-gather when it resharded, and its reduce-scatter
    each bring their copy onto the compute stream: compute is unchanged, and the step grows by their
    sum less at most the communication that was exposed before (a copy may run while the compute
    stream would have waited for a later collective), never by more than their sum."""
    profile = _quiet(h100)
    for mb in (256, 2):
        plan = synth_plan(synth, 8, mb=mb, reshard=reshard)
        with_copies = simulate_time(synth, plan, profile)
        without = simulate_time(synth, plan, dataclasses.replace(profile, fsdp_copies=False))
        out, into = _copies(synth, plan, profile)
        gathers = [1 if (u.is_root or not u.reshard_after_forward) else 2 for u in plan.units]
        added = sum(g * o + i for g, o, i in zip(gathers, out, into))
        grew = with_copies.step_time_s - without.step_time_s
        assert with_copies.compute_s == without.compute_s
        assert added - without.exposed_comm_s - 1e-12 <= grew <= added + 1e-12, (mb, grew, added)
        assert grew > 0.5 * added if mb == 256 else grew > 0


def test_resharding_costs_a_second_copy_out(synth, h100):
    """Resharding after forward costs each inner unit one more copy-out (the root never reshards), in
    backward, where every all-gather hides behind the previous unit's compute."""
    profile = _quiet(h100)
    steps = {(r, c): simulate_time(synth, synth_plan(synth, 8, mb=256, reshard=r),
                                   dataclasses.replace(profile, fsdp_copies=c)).step_time_s
             for r in (True, False) for c in (True, False)}
    out, _ = _copies(synth, synth_plan(synth, 8, mb=256), profile)
    extra = (steps[True, True] - steps[False, True]) - (steps[True, False] - steps[False, False])
    assert extra == pytest.approx(sum(out[1:]), rel=1e-6)
