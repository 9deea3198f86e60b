"""CPU ranks that outnumber the host's cores: cost/host_share.py [Note: CPU ranks sharing cores]."""

import dataclasses

import pytest

from shard_planner.cost import CostModel
from shard_planner.cost.host_share import core_share, host_factors, shared_profile, threads_per_rank
from shard_planner.execute.calibrate import CollectiveFit, to_toml
from shard_planner.hardware.profile import load_profile
from tests.cost.test_cost_model import mlp_plan
from tests.execute.test_module_timings import _timings
from tests.models import cost_mlp


@pytest.fixture(scope="module")
def mlp():
    return cost_mlp.analytic_trace(128, 4)


def test_threads_per_rank_splits_the_cores_as_torchrun_does():
    assert threads_per_rank(1, 8) == 8
    assert threads_per_rank(2, 8) == 4
    assert threads_per_rank(3, 8) == 2
    assert threads_per_rank(4, 2) == 1
    assert threads_per_rank(0, 2) == 2


@pytest.mark.parametrize("ranks, cores, threads, share", [
    (1, 2, None, 1.0), (2, 2, None, 1.0), (3, 2, None, 1.5), (4, 2, None, 2.0), (16, 4, None, 4.0),
    (2, 2, 2, 2.0),  # OMP_NUM_THREADS=2 on each of 2 ranks: 4 threads on 2 cores
    (4, 0, None, 1.0),  # cores unknown: no sharing
])
def test_core_share(ranks, cores, threads, share):
    assert core_share(ranks, cores, threads) == share


def test_gpu_profiles_and_profiles_without_cores_never_share(gloo, h100):
    assert host_factors(h100, 64) == (1.0, 1.0, 1.0)
    assert shared_profile(h100, 64) is h100
    unknown = dataclasses.replace(gloo, host_cores=0)
    assert shared_profile(unknown, 4) is unknown


def test_factors_follow_what_the_profile_and_the_timings_measured(gloo):
    assert (gloo.host_cores, gloo.measured_ranks) == (2, 2)
    assert host_factors(gloo, 2) == (1.0, 1.0, 1.0)
    assert host_factors(gloo, 4) == (2.0, 2.0, 1.0)
    assert host_factors(gloo, 8) == (4.0, 4.0, 1.0)
    # overheads measured by 4 ranks on 2 cores hold the share already; compute was measured alone
    assert host_factors(dataclasses.replace(gloo, measured_ranks=4), 4) == (2.0, 1.0, 1.0)
    assert host_factors(dataclasses.replace(gloo, measured_ranks=4), 2) == (1.0, 0.5, 1.0)
    # module timings measured by 4 processes at once on 2 cores already ran at a half share
    assert host_factors(gloo.with_timings(_timings(world_size=4)), 4)[2] == 1.0
    assert host_factors(gloo.with_timings(_timings(world_size=2)), 4)[2] == 2.0
    assert host_factors(gloo.with_timings(_timings(world_size=4)), 2)[2] == 0.5


def test_a_cpu_step_of_four_ranks_on_two_cores_takes_twice_as_long(mlp, gloo):
    """Every part of a CPU step is host work (compute, overheads, gloo's side of the collectives,
    the optimizer), each slowed by the same share: the step exactly doubles."""
    plan = mlp_plan(4)
    alone = CostModel(mlp, dataclasses.replace(gloo, host_cores=0)).time(plan)
    shared = CostModel(mlp, gloo).time(plan)
    assert shared.step_time_s == pytest.approx(2 * alone.step_time_s, rel=1e-9)
    assert shared.compute_s == pytest.approx(2 * alone.compute_s, rel=1e-9)
    assert shared.comm_s == pytest.approx(2 * alone.comm_s, rel=1e-9)
    assert shared.optimizer_s == pytest.approx(2 * alone.optimizer_s, rel=1e-9)
    # two ranks on two cores: unchanged
    assert CostModel(mlp, gloo).time(mlp_plan(2)).step_time_s == pytest.approx(
        CostModel(mlp, dataclasses.replace(gloo, host_cores=0)).time(mlp_plan(2)).step_time_s, rel=1e-12)


def test_measured_module_times_are_not_shared_twice(mlp, gloo):
    """Module times measured by as many processes as the plan's ranks hold the share already: only
    the profile's overheads and collectives (measured by 2 ranks) are scaled."""
    timings = _timings(fingerprint=mlp.fingerprint, world_size=4)
    at4 = gloo.with_timings(timings)
    plan = mlp_plan(4, mb=4)
    shared = CostModel(mlp, at4).time(plan)
    alone = CostModel(mlp, dataclasses.replace(at4, host_cores=0)).time(plan)
    # the measured blocks are the same; the per-unit overhead (host time of the blocks) doubles
    n_units = len(plan.units)
    assert shared.compute_s == pytest.approx(alone.compute_s + n_units * gloo.per_unit_overhead_s, rel=1e-9)
    assert shared.comm_s == pytest.approx(2 * alone.comm_s, rel=1e-9)


def test_one_cost_model_prices_each_world_size_with_its_own_share(mlp, gloo):
    cm = CostModel(mlp, gloo)
    assert cm.for_world(2) is cm
    assert cm.for_world(4) is cm.for_world(4)
    assert cm.for_world(4).for_world(4) is cm.for_world(4)  # shared once, not again
    t2, t4 = cm.time(mlp_plan(2)), cm.time(mlp_plan(4))
    assert t4.step_time_s == pytest.approx(CostModel(mlp, gloo).time(mlp_plan(4)).step_time_s, rel=1e-12)
    assert t2.step_time_s < t4.step_time_s
    # memory does not depend on the share
    assert cm.memory(mlp_plan(4), timeline=False).peak_bytes == \
        CostModel(mlp, dataclasses.replace(gloo, host_cores=0)).memory(mlp_plan(4), timeline=False).peak_bytes


def test_calibrate_writes_the_cores_and_ranks_it_measured_with(tmp_path):
    profile = dataclasses.replace(load_profile("cpu-gloo"), host_cores=16, measured_ranks=4, source="")
    fit = CollectiveFit(latency_s=1e-4, busbw_bytes_per_s=1e9, samples=((1024, 1e-4),))
    path = tmp_path / "p.toml"
    path.write_text(to_toml(profile, {"all_gather": fit, "reduce_scatter": fit}, 4))
    back = load_profile(str(path))
    assert (back.host_cores, back.measured_ranks) == (16, 4)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_bad_core_counts_are_one_profile_error(tmp_path, value):
    from shard_planner.errors import ProfileError

    text = open(load_profile("cpu-gloo").source).read()
    text = text.replace("host_cores = 2", f"host_cores = {value!r}".replace("True", "true").replace("'", '"'))
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match="host_cores must be a whole number >= 0"):
        load_profile(str(path))


def test_the_planner_says_when_ranks_outnumber_the_cores(gloo, caplog):
    from shard_planner.solve import PlanRequest, plan_model
    from tests.models.solve_traces import stack_trace

    trace = stack_trace(4)
    with caplog.at_level("WARNING", logger="shard_planner.solve.planner"):
        plan_model(trace, PlanRequest(gpus=4, mem_budget_bytes=8 * 2**30, profile=gloo, frontier_points=2))
    assert "4 ranks share this host's 2 cores: each runs at 1/2 of a core" in caplog.text
    assert "calibrate --world-size 4" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="shard_planner.solve.planner"):
        plan_model(trace, PlanRequest(gpus=2, mem_budget_bytes=8 * 2**30, profile=gloo, frontier_points=2))
    assert "share this host" not in caplog.text
