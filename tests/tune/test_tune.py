"""``tune``: the profile fit, the fitted profile file, the rounds / early stop / choice logic (pure, with a
synthetic cost model and synthetic runs), the CLI's errors, and one real tune at world size 2 (gloo)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest

from shard_planner.errors import InfeasibleError, UserError
from shard_planner.plan.measurement import Measurement, RankMemory, plan_fingerprint
from shard_planner.plan import (
    Cluster, MeasuredPoint, Mesh, ModelRef, Plan, Prediction, Prefetch, Training, Unit, load_plan,
)
from shard_planner.hardware.profile import load_profile
from shard_planner.tune.candidates import Candidate, describe_plan
from shard_planner.tune.fit import FACTORS, fit_profile, scale_profile
from shard_planner.tune.profile_file import profile_toml
from shard_planner.tune.tuner import tune
from tests.paths import REPO  # noqa: E402

ROOT_DIR = REPO
PRIOR = load_profile("cpu-gloo")


# ---- a synthetic cost model: step time linear in compute, bytes and collective count ----
def _features(plan: Plan) -> tuple[float, float, float]:
    """(FLOPs, collective bytes, collectives) of a made-up model, different for every decision."""
    units = [u for u in plan.units if not u.is_root]
    ac = sum(u.activation_checkpoint for u in units)
    keep = sum(u.reshard_after_forward is False for u in units)
    flops = 1e10 * (1 + 0.3 * ac / max(1, len(units))) * plan.training.micro_batch
    comm_bytes = 2e7 * (3 - keep / max(1, len(units))) * (1 + 0.1 * plan.prefetch.forward)
    collectives = 3 * len(units) - keep
    return flops, comm_bytes, collectives


def synthetic_time(plan: Plan, profile) -> float:
    flops, comm_bytes, collectives = _features(plan)
    ic = profile.interconnect
    return (flops / profile.flops_per_s(plan.training.param_dtype)
            + comm_bytes / ic.intra_node_busbw_bytes_per_s + collectives * ic.intra_node_latency_s)


@dataclass(frozen=True)
class _Time:
    step_time_s: float


@dataclass(frozen=True)
class _Estimate:
    time: _Time
    peak_bytes: int

    def prediction(self) -> Prediction:
        return Prediction(peak_bytes=self.peak_bytes, step_time_s=self.time.step_time_s, memory_at_peak={},
                          samples_per_s=1.0 / self.time.step_time_s)


def synthetic_estimate(trace, plan: Plan, profile) -> _Estimate:
    keep = sum(u.reshard_after_forward is False for u in plan.units if not u.is_root)
    return _Estimate(_Time(synthetic_time(plan, profile)), peak_bytes=(100 + 10 * keep) * 2**20)


TRUE_FACTORS = {"compute": 1.6, "bandwidth": 2.5, "latency": 4.0}  # the "machine" the fit must find


def fake_run_plans(calls: list, *, peaks: dict[str, int] | None = None):
    truth = scale_profile(PRIOR, TRUE_FACTORS)

    def run_plans(plans, *, world_size, steps, warmup, timeout_s, device):
        calls.append(len(plans))
        out = []
        for p in plans:
            t = synthetic_time(p, truth)
            peak = (peaks or {}).get(plan_fingerprint(p), 90 * 2**20)
            out.append(Measurement(
                plan_fingerprint=plan_fingerprint(p), model_path=p.model.path, world_size=world_size,
                mesh_shard=world_size, mesh_replicate=1, micro_batch=p.training.micro_batch, device="cpu",
                device_name="synthetic", backend="gloo", torch_version="x", memory_method="storage-tracker",
                memory=tuple(RankMemory(r, peak) for r in range(world_size)), step_time_s=(t, t * 1.001, t),
                timing_method="wall clock", warmup_steps=warmup, losses=(1.0,) * (steps + warmup)))
        return out
    return run_plans


def make_plan(*, keep: int = 0, ac: int = 0, prefetch: int = 0, gpus: int = 2, reshard_int: bool = False) -> Plan:
    units = [Unit(("",), reshard_after_forward=False)]
    for i in range(4):
        reshard = 2 if reshard_int and i == 0 else i < 4 - keep  # keep: the last `keep` blocks keep params
        units.append(Unit((f"blocks.{i}",), reshard_after_forward=reshard, activation_checkpoint=i < ac))
    return Plan(model=ModelRef("tests/models/none.py", "f" * 16), mesh=Mesh(shard=gpus),
                cluster=Cluster(gpus=gpus, gpus_per_node=8, profile="cpu-gloo", mem_budget_bytes=200 * 2**20),
                training=Training(micro_batch=2), units=tuple(units), prefetch=Prefetch(forward=prefetch))


def candidates_of(plans: list[Plan]) -> list[Candidate]:
    cands = [Candidate(replace(p, predicted=synthetic_estimate(None, p, PRIOR).prediction()), f"c{i}")
             for i, p in enumerate(plans)]
    return sorted(cands, key=lambda c: c.plan.predicted.step_time_s)


# ---- fit ----
def test_fit_recovers_the_factors_of_a_linear_model():
    plans = [make_plan(keep=k, ac=a, prefetch=f) for k, a, f in ((0, 0, 0), (4, 0, 1), (2, 4, 0), (0, 2, 2), (4, 4, 2))]
    truth = scale_profile(PRIOR, TRUE_FACTORS)
    measured = [synthetic_time(p, truth) for p in plans]
    fit = fit_profile(PRIOR, lambda prof: [synthetic_time(p, prof) for p in plans], measured, ridge=1e-9)
    for name in FACTORS:
        assert fit.factors[name] == pytest.approx(TRUE_FACTORS[name], rel=0.02), name
    assert fit.max_abs_error_after < 1e-3
    assert max(abs(e) for e in fit.errors_before) > 0.3
    assert fit.profile.compute_efficiency == pytest.approx(PRIOR.compute_efficiency / fit.factors["compute"])


def test_fit_keeps_an_unobserved_factor_at_the_prior():
    plans = [make_plan(ac=a) for a in (0, 2, 4)]

    def predict(prof):  # compute only: the runs say nothing about bandwidth or latency
        return [_features(p)[0] / prof.flops_per_s("bfloat16") for p in plans]

    measured = [2 * v for v in predict(PRIOR)]
    fit = fit_profile(PRIOR, predict, measured)
    assert fit.factors["compute"] == pytest.approx(2.0, rel=0.01)
    assert fit.factors["bandwidth"] == pytest.approx(1.0) and fit.factors["latency"] == pytest.approx(1.0)


def test_fit_rejects_bad_measurements():
    with pytest.raises(UserError, match="no runs"):
        fit_profile(PRIOR, lambda prof: [], [])
    with pytest.raises(UserError, match="positive"):
        fit_profile(PRIOR, lambda prof: [1.0], [0.0])


def test_fitted_profile_file_round_trips(tmp_path):
    plans = [make_plan(keep=k, ac=a) for k, a in ((0, 0), (4, 2), (2, 4))]
    truth = scale_profile(PRIOR, TRUE_FACTORS)
    fit = fit_profile(PRIOR, lambda prof: [synthetic_time(p, prof) for p in plans],
                      [synthetic_time(p, truth) for p in plans])
    path = tmp_path / "fitted.toml"
    path.write_text(profile_toml(fit, PRIOR, ["fitted from 3 synthetic runs"]))
    loaded = load_profile(str(path))
    assert replace(loaded, source="") == replace(fit.profile, source="")
    text = path.read_text()
    assert text.startswith("# fitted from 3 synthetic runs")
    assert text.count("# fitted (") == 5  # efficiency, two bandwidths, two latencies


def test_fitted_profile_keeps_the_kernels_dtype_sub_tables(tmp_path):
    """A prior's [kernels.bfloat16] (cost/kernels.py kernel_constants) is written back as a sub-table."""
    from shard_planner.cost.kernels import kernel_constants

    base = load_profile("cpu-gloo-roofline")
    sub = {"matmul_layout_efficiency": [1.0, 0.08, 0.08, 1.0], "attention_bwd_efficiency": 0.2}
    prior = replace(base, kernels={**base.kernels, "bfloat16": sub})
    fit = fit_profile(prior, lambda prof: [1.0], [1.0])
    path = tmp_path / "fitted.toml"
    path.write_text(profile_toml(fit, prior, ["fitted"]))
    loaded = load_profile(str(path))
    assert loaded.kernels["bfloat16"] == sub
    assert kernel_constants(loaded, "bfloat16").matmul_layout_efficiency == (1.0, 0.08, 0.08, 1.0)
    assert kernel_constants(loaded, "float32") == kernel_constants(base, "float32")


# ---- rounds, early stop, choice ----
def test_tune_runs_in_rounds_and_returns_the_measured_best():
    plans = [make_plan(keep=k, ac=a, prefetch=f) for k, a, f in ((4, 0, 0), (0, 0, 0), (2, 4, 1), (0, 4, 2))]
    calls = []
    result = tune(None, candidates_of(plans), PRIOR, estimate=synthetic_estimate, run_plans=fake_run_plans(calls),
                  per_launch=2)
    assert calls[0] == 2 and result.launches == len(calls)
    measured = [t.measured_s for t in result.trials]
    assert result.best.measured_s == min(measured)
    assert result.plan.measurements and sum(p.chosen for p in result.plan.measurements) == 1
    chosen_point = next(p for p in result.plan.measurements if p.chosen)
    assert chosen_point.step_time_s == min(measured)
    assert plan_fingerprint(replace(result.plan, predicted=None, solver=None, measurements=())) == \
        plan_fingerprint(result.best.candidate.plan)
    assert result.plan.solver.method == "tune"
    assert len(result.trials) + len(result.skipped) == len(plans)
    assert result.fit.max_abs_error_after < max(abs(e) for e in result.fit.errors_before)
    # the plan file carries every measurement and reads back
    assert Plan.from_dict(json.loads(result.plan.to_json())) == result.plan


def test_tune_stops_early_when_no_candidate_can_win():
    # The first round's plans are the fastest by far: the slow ones cannot beat them after the fit.
    fast = [make_plan(keep=4), make_plan(keep=3)]
    slow = [replace(make_plan(ac=4), training=Training(micro_batch=16)),
            replace(make_plan(ac=3), training=Training(micro_batch=16))]
    calls = []
    result = tune(None, candidates_of(fast + slow), PRIOR, estimate=synthetic_estimate,
                  run_plans=fake_run_plans(calls), per_launch=2)
    assert calls == [2]
    assert len(result.skipped) == 2 and all("measured best" in s.reason for s in result.skipped)


def test_tune_never_returns_a_plan_measured_over_budget():
    plans = [make_plan(keep=4), make_plan(keep=0), make_plan(keep=2, ac=2)]
    cands = candidates_of(plans)
    fastest = cands[0].plan
    over = {plan_fingerprint(fastest): 300 * 2**20}  # the budget is 200 MiB
    result = tune(None, cands, PRIOR, estimate=synthetic_estimate, run_plans=fake_run_plans([], peaks=over),
                  per_launch=3)
    assert plan_fingerprint(result.best.run_plan) != plan_fingerprint(fastest)
    assert result.best.measurement.peak_bytes <= fastest.cluster.mem_budget_bytes
    everything_over = {plan_fingerprint(c.plan): 300 * 2**20 for c in cands}
    with pytest.raises(InfeasibleError, match="over the"):
        tune(None, cands, PRIOR, estimate=synthetic_estimate, run_plans=fake_run_plans([], peaks=everything_over),
             per_launch=3)


def test_tune_rederives_for_the_run_world_size():
    plans = [make_plan(gpus=8, keep=k) for k in (0, 4)] + [make_plan(gpus=8, reshard_int=True)]
    calls = []
    result = tune(None, candidates_of(plans), PRIOR, estimate=synthetic_estimate, run_plans=fake_run_plans(calls),
                  world_size=2, per_launch=3)
    assert result.rederived and result.world_size == 2
    # reshard to 2 ranks becomes True at world size 2: that candidate equals the all-reshard one and runs once
    assert sum(calls) == 2
    assert all(t.run_plan.mesh.world_size == 2 for t in result.trials)
    assert result.plan.cluster.gpus == 8 and result.plan.mesh.shard == 8
    assert all(p.world_size == 2 for p in result.plan.measurements)


def test_describe_plan():
    text = describe_plan(make_plan(keep=1, ac=2, prefetch=1))
    assert text == "4+root units, reshard F:1,T:3, root reshard F, AC 2, pf 1/1, mb 2"
    root = make_plan(keep=1)
    root = replace(root, units=(replace(root.units[0], reshard_after_forward=True),) + root.units[1:])
    assert "root reshard T" in describe_plan(root)  # plans that differ only in the root's reshard differ


def test_plan_without_measurements_still_loads():
    d = json.loads(make_plan().to_json())
    del d["measurements"]
    assert Plan.from_dict(d).measurements == ()
    assert isinstance(MeasuredPoint("x", "f", 2, 1, 0.1), MeasuredPoint)


# ---- CLI ----
def test_cli_rejects_bad_arguments(capsys):
    from shard_planner.cli.main import main

    model = str(ROOT_DIR / "examples" / "gpt2.py")
    assert main(["tune", model, "--gpus", "2", "--mem", "lots"]) == 2
    assert "--mem must be a positive memory size such as 40GB, 80GiB or 512MB, got 'lots'" in capsys.readouterr().err
    assert main(["tune", model, "--gpus", "2", "--mem", "1GB", "--trials", "0"]) == 2
    assert "--trials must be a positive integer, got '0'" in capsys.readouterr().err
    assert main(["tune", model, "--gpus", "0", "--mem", "1GB"]) == 2
    assert "--gpus must be a positive integer, got '0'" in capsys.readouterr().err


# ---- candidates ----
def test_top_candidates_are_distinct_fit_and_include_the_solvers_plan():
    from shard_planner.tune.candidates import top_candidates

    solver_plan = replace(make_plan(keep=4), predicted=synthetic_estimate(None, make_plan(keep=4), PRIOR).prediction())
    budgets = []

    def solve(mem_budget_bytes):  # a tighter budget: fewer units keep their parameters (synthetic peak 100 + 10/unit MiB)
        budgets.append(PRIOR.tensor_budget_bytes(mem_budget_bytes))  # what the solver fills of that --mem
        keep = int((budgets[-1] / 2**20 - 100) // 10)
        if keep < 0:
            raise InfeasibleError("too tight")
        return make_plan(keep=min(4, keep))

    cands = top_candidates(None, solver_plan, PRIOR, 4, solve=solve, estimate=synthetic_estimate)
    keys = [plan_fingerprint(c.plan) for c in cands]
    assert len(cands) == 4 and len(set(keys)) == 4
    assert plan_fingerprint(solver_plan) in keys
    assert all(c.plan.predicted.peak_bytes <= PRIOR.tensor_budget_bytes(solver_plan.cluster.mem_budget_bytes)
               for c in cands)
    times = [c.plan.predicted.step_time_s for c in cands]
    assert times == sorted(times)
    assert budgets and max(budgets) < solver_plan.predicted.peak_bytes  # re-solved below the plan's peak
    assert all(c.plan.cluster.mem_budget_bytes == solver_plan.cluster.mem_budget_bytes for c in cands)


# ---- the real thing: tune at world size 2 over gloo ----
@pytest.mark.multiprocess
def test_tune_gpt2_world_size_2_three_trials(tmp_path, capsys):
    from shard_planner.cli.main import main

    out = tmp_path / "plan.json"
    fitted = tmp_path / "fitted.toml"
    rc = main(["tune", str(ROOT_DIR / "examples" / "gpt2.py"), "--gpus", "2", "--mem", "1GB", "--trials", "3",
               "--world-size", "2", "--per-launch", "3", "--steps", "3", "--warmup", "1", "--device", "cpu",
               "-o", str(out), "--profile-out", str(fitted), "--report", str(tmp_path / "report")])
    text = capsys.readouterr()
    assert rc == 0, text.err
    plan = load_plan(out)
    runs = plan.measurements
    assert 1 <= len(runs) <= 3 and len({r.plan_fingerprint for r in runs}) == len(runs)
    chosen = [r for r in runs if r.chosen]
    assert len(chosen) == 1
    # the returned plan is the measured best of those it ran, and it is the plan that ran
    assert chosen[0].step_time_s == min(r.step_time_s for r in runs)
    # (the runs were planned with the prior profile; the returned plan names the fitted one)
    ran_as = {plan_fingerprint(replace(plan, cluster=replace(plan.cluster, profile=name)))
              for name in ("cpu-gloo", PRIOR.source)}
    assert chosen[0].plan_fingerprint in ran_as
    assert all(r.peak_bytes <= plan.cluster.mem_budget_bytes for r in runs)
    assert plan.solver.method == "tune"
    # a calibrated profile: loads, says it was fitted, and the plan now names it
    profile = load_profile(str(fitted))
    body = fitted.read_text()
    assert "Fitted by `shard-planner tune`" in body and body.count("# fitted (") == 5
    assert profile.compute_efficiency > 0 and profile.interconnect.intra_node_busbw_bytes_per_s > 0
    assert plan.cluster.profile == str(fitted)
    assert (tmp_path / "report" / "report.html").is_file()
    assert "chosen: run" in text.out


def test_tune_keeps_running_while_nothing_measured_fits():
    plans = [make_plan(keep=4), make_plan(keep=0), make_plan(keep=2, ac=2)]
    cands = candidates_of(plans)
    over = {plan_fingerprint(cands[0].plan): 300 * 2**20}  # the first round's only plan is over budget
    calls = []
    result = tune(None, cands, PRIOR, estimate=synthetic_estimate, run_plans=fake_run_plans(calls, peaks=over),
                  per_launch=1)
    assert len(calls) >= 2 and result.best.measurement.peak_bytes <= cands[0].plan.cluster.mem_budget_bytes


def test_tune_reports_a_candidate_that_fails_to_run_and_goes_on():
    from shard_planner.errors import RunError

    plans = [make_plan(keep=4), make_plan(keep=0), make_plan(keep=2, ac=2)]
    cands = candidates_of(plans)
    bad = plan_fingerprint(cands[1].plan)
    inner = fake_run_plans([])

    def run_plans(ps, **kw):
        if any(plan_fingerprint(p) == bad for p in ps):
            raise RunError("rank 0 raised ValueError: shared parameter")
        return inner(ps, **kw)

    result = tune(None, cands, PRIOR, estimate=synthetic_estimate, run_plans=run_plans, per_launch=3)
    assert len(result.trials) == 2 and plan_fingerprint(result.best.run_plan) != bad
    assert [s.reason for s in result.skipped] == ["failed to run: rank 0 raised ValueError: shared parameter"]
    with pytest.raises(RunError, match="no candidate plan ran"):
        tune(None, [cands[1]], PRIOR, estimate=synthetic_estimate, run_plans=run_plans)
