"""``estimate --recipe NAME``: a recipe (shard_planner/plan/recipes.py) priced on a model without a plan file, the
same figures as the recipe's plan written by hand and priced with ``estimate --plan`` (issue 38, item 1)."""

import pytest

from tests.execute import test_module_timings as tm

from shard_planner.cli.main import main
from shard_planner.cost import estimate
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Training
from shard_planner.hardware.profile import load_profile
from shard_planner.plan.recipes import recipe_named
from shard_planner.solve.space import build_space
from shard_planner.units import format_duration


@pytest.fixture()
def trace_path(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(tm.cost_mlp.analytic_trace().to_json())
    return str(path)


def test_estimate_recipe_prices_the_recipe_as_a_hand_written_plan(trace_path, capsys):
    trace = tm.cost_mlp.analytic_trace()
    assert main(["estimate", trace_path, "--recipe", "zero2-like", "--gpus", "2", "--mem", "1GB", "--profile",
                 "cpu-gloo", "--micro-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("recipe ZeRO-2-like (no reshard): fixes wrap, reshard")
    assert "the planner's: micro-batch, gradient accumulation, tensor-parallel degree, prefetch" in out
    units = recipe_named("zero2-like").units(build_space(trace, shard_group=2, gpus_per_node=8))
    by_hand = Plan(model=ModelRef(path=trace_path, fingerprint=trace.fingerprint),
                   cluster=Cluster(gpus=2, gpus_per_node=8, profile="cpu-gloo", mem_budget_bytes=2**30),
                   mesh=Mesh(shard=2), training=Training(micro_batch=4), units=units)
    est = estimate(trace, by_hand, load_profile("cpu-gloo"))
    assert f"step time: {format_duration(est.time.step_time_s)} =" in out


def test_estimate_recipe_refuses_what_it_cannot_do(trace_path, capsys):
    assert main(["estimate", trace_path, "--recipe", "torchtitan", "--profile", "cpu-gloo"]) == 2
    assert "needs --gpus N" in capsys.readouterr().err
    assert main(["estimate", trace_path, "--plan", "plan.json", "--mem", "1GB"]) == 2
    assert "--mem, --dtype, --engine and --optimizer-in-backward are for --recipe" in capsys.readouterr().err
    assert main(["estimate", trace_path, "--recipe", "titan", "--gpus", "2"]) == 2  # argparse's choices
    assert "invalid choice: 'titan' (choose from 'torchtitan'," in capsys.readouterr().err
