"""Compute slowed by overlapped collectives (shard_planner/cost/overlap.py [Note: Compute slowdown under
overlapped collectives]) and its use in the two-stream simulation (cost/time.py)."""

import dataclasses
import math

import pytest

from shard_planner.cost import simulate_time
from shard_planner.cost.overlap import hidden_comm_cost_share, overlapped_compute_end_s
from shard_planner.errors import ProfileError
from shard_planner.hardware.profile import load_profile
from tests.cost.test_cost_model import mlp_plan, synth_plan
from tests.models import cost_mlp

SLOWDOWN = 0.25


def _with(profile, slowdown):
    return dataclasses.replace(profile, overlap_compute_slowdown=slowdown)


def _scaled_links(profile, factor):
    ic = profile.interconnect
    ic = dataclasses.replace(ic, intra_node_busbw_bytes_per_s=ic.intra_node_busbw_bytes_per_s * factor,
                             inter_node_busbw_bytes_per_s=ic.inter_node_busbw_bytes_per_s * factor)
    return dataclasses.replace(profile, interconnect=ic)


# ---- the formula ----
def test_no_overlap_no_slowdown():
    assert overlapped_compute_end_s(1.0, 0.5, 0.9, SLOWDOWN) == 1.5  # the collective ended before
    assert overlapped_compute_end_s(1.0, 0.5, 1.0, SLOWDOWN) == 1.5
    assert overlapped_compute_end_s(1.0, 0.5, 3.0, 0.0) == 1.5  # no slowdown (CPU, older profiles)
    assert overlapped_compute_end_s(1.0, 0.0, 3.0, SLOWDOWN) == 1.0  # no compute


def test_inside_and_across_the_collective():
    # wholly inside: w (1 + s)
    assert overlapped_compute_end_s(0.0, 1.0, 10.0, SLOWDOWN) == pytest.approx(1.25)
    # across: 0.5 s at 1 / 1.25 does 0.4 s of work, the remaining 0.6 s runs at full speed after
    assert overlapped_compute_end_s(0.0, 1.0, 0.5, SLOWDOWN) == pytest.approx(1.1)


def test_monotone_and_bounded_by_the_hidden_collective():
    start, work = 2.0, 1.0
    share = hidden_comm_cost_share(SLOWDOWN)
    assert share == pytest.approx(0.2)
    ends = []
    for k in range(0, 41):
        busy_until = start + 0.05 * k
        end = overlapped_compute_end_s(start, work, busy_until, SLOWDOWN)
        added = end - start - work
        assert 0.0 <= added <= min(work * SLOWDOWN, (busy_until - start) * share) + 1e-12
        ends.append(end)
    assert ends == sorted(ends) and ends[-1] > ends[0]
    assert ends[-1] == pytest.approx(start + work * (1 + SLOWDOWN))  # the collective outlasts the compute


# ---- the two-stream simulation ----
def test_nothing_overlaps_nothing_changes(synth, h100):
    # one rank: no collectives, nothing beside the compute
    plan = synth_plan(synth, 1, mb=2)
    assert simulate_time(synth, plan, _with(h100, SLOWDOWN)).step_time_s == \
        simulate_time(synth, plan, _with(h100, 0.0)).step_time_s


def test_overlapped_compute_costs_at_most_the_hidden_share(synth, h100):
    for world, mb, fwd in ((8, 2, 0), (16, 2, 1), (64, 1, 2)):
        plan = synth_plan(synth, world, mb=mb, fwd=fwd)
        alone = simulate_time(synth, plan, _with(h100, 0.0))
        slowed = simulate_time(synth, plan, _with(h100, SLOWDOWN))
        added = slowed.step_time_s - alone.step_time_s
        assert 0.0 < added <= hidden_comm_cost_share(SLOWDOWN) * alone.comm_s + 1e-12
        assert slowed.compute_s == alone.compute_s and slowed.comm_s == alone.comm_s
        assert slowed.exposed_comm_s == pytest.approx(alone.exposed_comm_s + added)
        assert sum(u.exposed_comm_s for u in slowed.units) == pytest.approx(slowed.exposed_comm_s, rel=1e-9)


def test_monotone_in_overlapped_communication(synth, h100):
    # slower links, communication still hidden: more of the compute runs beside a collective (FSDP2's
    # copies, which count as exposed communication too, are left out: this is about the collectives)
    plan = synth_plan(synth, 16, mb=4)
    h100 = dataclasses.replace(h100, fsdp_copies=False)
    added = []
    for factor in (1.0, 0.5, 0.25):
        alone = simulate_time(synth, plan, _scaled_links(_with(h100, 0.0), factor))
        assert alone.exposed_comm_s < 0.2 * alone.comm_s  # mostly hidden (the first and last collectives are not)
        added.append(simulate_time(synth, plan, _scaled_links(_with(h100, SLOWDOWN), factor)).step_time_s
                     - alone.step_time_s)
    assert 0.0 < added[0] < added[1] < added[2]


def test_monotone_in_the_slowdown(synth, h100):
    plan = synth_plan(synth, 16, mb=2)
    steps = [simulate_time(synth, plan, _with(h100, s)).step_time_s for s in (0.0, 0.1, 0.189, 0.4, 1.0)]
    assert steps == sorted(steps) and steps[0] < steps[-1]


def test_gradient_accumulation_slows_every_micro_step(synth, h100):
    plan = synth_plan(synth, 16, mb=2)
    plan4 = dataclasses.replace(plan, training=dataclasses.replace(plan.training, accumulation_steps=4))
    one = [simulate_time(synth, plan, _with(h100, s)) for s in (0.0, SLOWDOWN)]
    four = [simulate_time(synth, plan4, _with(h100, s)) for s in (0.0, SLOWDOWN)]
    # FSDP2 without no_sync: each micro-step gathers and reduces as one step does
    assert four[1].step_time_s - four[0].step_time_s == pytest.approx(4 * (one[1].step_time_s - one[0].step_time_s))


# ---- CPU and profiles ----
def test_cpu_profiles_price_as_before(gloo):
    assert gloo.overlap_compute_slowdown == 0.0 and load_profile("cpu-gloo-roofline").overlap_compute_slowdown == 0.0
    mlp = cost_mlp.analytic_trace(256, 4)
    for plan in (mlp_plan(2), mlp_plan(4, fwd=1, mb=8), mlp_plan(2, reshard=False)):
        # gloo is synchronous on the computing thread: nothing overlaps, so no slowdown applies
        assert simulate_time(mlp, plan, _with(gloo, 0.5)) == simulate_time(mlp, plan, gloo)


def test_profiles_without_the_key_read_zero():
    assert load_profile("l4").overlap_compute_slowdown == 0.0


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf])
def test_invalid_slowdown_is_a_profile_error(h100, bad):
    with pytest.raises(ProfileError, match="overlap_compute_slowdown"):
        _with(h100, bad)

