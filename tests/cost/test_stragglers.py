"""The slowest GPU of the job sets the pace (shard_planner/cost/stragglers.py [Note: Stragglers: the
slowest of N GPUs]) and its use in the step-time simulation (cost/time.py)."""

import dataclasses

import pytest

from shard_planner.cost import simulate_time
from shard_planner.cost.stragglers import expected_max_std_normal, straggler_factor
from shard_planner.errors import ProfileError
from shard_planner.hardware.profile import load_profile
from tests.cost.test_cost_model import synth_plan

SPREAD = 0.02


def _with(profile, spread):
    return dataclasses.replace(profile, gpu_speed_spread=spread)


# ---- the order statistic ----
@pytest.mark.parametrize("n, expected", [(1, 0.0), (2, 0.56419), (3, 0.84628), (5, 1.16296), (10, 1.53875),
                                         (100, 2.50759)])
def test_expected_maximum_of_normal_samples(n, expected):
    # E[max of n standard normals]: n = 2 is 1 / sqrt(pi); the rest from Harter (1961), Biometrika 48
    assert expected_max_std_normal(n) == pytest.approx(expected, abs=2e-5)


def test_factor_grows_with_the_job_and_is_one_without_spread():
    assert straggler_factor(1, 0.05) == 1.0  # one GPU waits for nobody
    assert straggler_factor(128, 0.0) == 1.0  # profiles without the key price as before
    factors = [straggler_factor(n, SPREAD) for n in (2, 8, 16, 64, 128)]
    assert factors == sorted(factors) and factors[0] > 1.0
    assert straggler_factor(8, SPREAD) == pytest.approx(1 / (1 - SPREAD * 1.42360), rel=1e-6)
    with pytest.raises(ValueError):
        straggler_factor(128, 0.5)  # the slowest GPU would have no speed left


# ---- in the step time ----
def test_compute_is_the_slowest_gpus(synth, h100):
    # no host overhead: every block is device-bound, so all of its time is the GPU's
    h100 = dataclasses.replace(h100, per_op_overhead_s=0.0, per_unit_overhead_s=0.0)
    for world in (8, 64):
        plan = synth_plan(synth, world, mb=2)
        alone = simulate_time(synth, plan, _with(h100, 0.0))
        slowed = simulate_time(synth, plan, _with(h100, SPREAD))
        k = straggler_factor(world, SPREAD)
        # every block's device time is k times longer
        assert slowed.compute_s == pytest.approx(k * alone.compute_s, rel=1e-9)
        assert slowed.comm_s == alone.comm_s  # the collectives are priced as before
        assert slowed.step_time_s > alone.step_time_s


def test_one_gpu_and_cpu_profiles_are_not_slowed(synth, h100):
    plan = synth_plan(synth, 1, mb=2)
    assert simulate_time(synth, plan, _with(h100, SPREAD)).step_time_s == \
        simulate_time(synth, plan, _with(h100, 0.0)).step_time_s
    cpu = load_profile("cpu-gloo")
    plan = synth_plan(synth, 4, mb=2)
    assert simulate_time(synth, plan, _with(cpu, SPREAD)).step_time_s == \
        simulate_time(synth, plan, cpu).step_time_s


def test_roofline_gpu_profiles_carry_the_spread_and_bad_values_are_refused(h100):
    # their kernel constants describe one typical GPU, so a job on N of them waits on the slowest
    for name in ("a100-80gb", "a100-40gb", "h200"):
        profile = load_profile(name)
        assert profile.compute_model == "roofline" and profile.gpu_speed_spread > 0, name
    assert h100.gpu_speed_spread == 0.0  # its compute_efficiency was fitted on 8 GPUs: holds it already
    for bad in (-0.01, float("nan"), float("inf")):
        with pytest.raises(ProfileError, match="gpu_speed_spread"):
            _with(h100, bad)
