"""``shard-planner estimate``: output, --gpus / --micro-batch / --write, and one-line errors."""

from dataclasses import replace

import pytest


from tests.models import cost_mlp  # noqa: E402

from shard_planner.cli.main import main  # noqa: E402
from shard_planner.cost import CostModel, estimate  # noqa: E402
from shard_planner.cost.fits import device_fit  # noqa: E402
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit, load_plan, save_plan  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from shard_planner.units import format_bytes  # noqa: E402


@pytest.fixture()
def files(tmp_path):
    trace = cost_mlp.analytic_trace()
    (tmp_path / "trace.json").write_text(trace.to_json())
    plan = Plan(model=ModelRef("tests/models/cost_mlp.py", trace.fingerprint),
                cluster=Cluster(2, 2, "cpu-gloo", 2**30), mesh=Mesh(2), training=Training(64),
                units=(Unit(("",), False),) + tuple(Unit((f"blocks.{i}",)) for i in range(4)),
                prefetch=Prefetch(0, 1))
    save_plan(plan, tmp_path / "plan.json")
    return trace, plan, tmp_path


def test_estimate_prints_peak_breakdown_and_step_time(files, capsys):
    trace, plan, d = files
    assert main(["estimate", str(d / "trace.json"), "--plan", str(d / "plan.json")]) == 0
    out = capsys.readouterr().out
    est = estimate(trace, plan, load_profile("cpu-gloo"))
    assert f"peak memory per CPU rank: {format_bytes(est.memory.peak_bytes)}" in out  # a cpu-gloo plan
    assert "backward: reduce-scatter blocks.3" in out
    for cat in est.memory.memory_at_peak:
        assert cat in out
    assert f"step time: {est.time.step_time_s * 1e3:.4g} ms" in out
    assert "samples/s" in out


def test_estimate_other_gpus_profile_and_write(files, capsys):
    trace, plan, d = files
    assert main(["estimate", str(d / "trace.json"), "--plan", str(d / "plan.json"), "--profile", "h100-80gb",
                 "--gpus", "8", "--micro-batch", "4", "--write"]) == 0
    out = capsys.readouterr().out
    assert "FSDP over 8 GPUs" in out and "micro-batch 4" in out and "h100-80gb" in out
    saved = load_plan(d / "plan.json")
    want = estimate(trace, replace(plan.with_world_size(8), training=Training(4)), load_profile("h100-80gb"))
    assert saved.predicted.peak_bytes == want.memory.peak_bytes
    # on a GPU profile: the plan's own allocator mode judged on --mem (cost/fits.py), the other beside it, and
    # the allocator's figures written with the prediction
    # (--mem 1 GiB on h100-80gb, whose CUDA context and NCCL take 1 GiB: nothing is left for the allocator)
    assert "on the GPU, as planned: DOES NOT FIT 1.00 GiB: the simulated allocator runs out of memory at" in out
    assert "expandable_segments:True, simulated" in out and "0 B for the allocator" in out
    assert "with expandable_segments:False (the default) instead: DOES NOT FIT 1.00 GiB" in out
    assert "with no memory limit it would hold at most" in out and "no retries from" not in out
    assert "OVER the search's budget, allocated, of" in out
    fit = device_fit(CostModel(trace, load_profile("h100-80gb")), saved)
    assert (saved.predicted.reserved_peak_bytes, saved.predicted.no_retry_bytes) == (
        fit.reserved_peak_total_bytes, fit.no_retry_total_bytes)


@pytest.mark.parametrize("args, message", [
    (["--plan", "missing.json"], "no such plan file"),
    (["--plan", "{plan}", "--profile", "h900"], "no profile 'h900'"),
    (["--plan", "{plan}", "--gpus", "0"], "--gpus must be a positive integer"),
])
def test_estimate_errors_are_one_line(files, capsys, args, message):
    _trace, _plan, d = files
    args = [a.replace("{plan}", str(d / "plan.json")) for a in args]
    assert main(["estimate", str(d / "trace.json"), *args]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_estimate_rejects_a_plan_for_another_model(files, capsys):
    trace, plan, d = files
    save_plan(replace(plan, model=ModelRef("x.py", "0000")), d / "other.json")
    assert main(["estimate", str(d / "trace.json"), "--plan", str(d / "other.json")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fingerprint" in err[0]
