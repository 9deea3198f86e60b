"""``estimate --write`` keeps the plan file consistent (plan/estimate.py, [Note: A plan file never
contradicts itself]): asked on another profile, number of GPUs, micro-batch or module timings, the file
records what was asked beside the prediction, and the search's sections for the old question go (issue 36,
item 5: ``estimate --profile a100-40gb --gpus 64 --write`` left ``cluster.profile: h100-80gb``)."""

import json

from tests.execute import test_module_timings as tm

from shard_planner.cli.main import main
from shard_planner.cost import estimate
from shard_planner.plan import load_plan
from shard_planner.hardware.profile import load_priced_profile


def _plan(tmp_path):
    trace = tm.cost_mlp.analytic_trace()
    trace_path = tmp_path / "trace.json"
    trace_path.write_text(trace.to_json())
    out = tmp_path / "plan.json"
    assert main(["plan", str(trace_path), "--gpus", "2", "--mem", "1GB", "--profile", "cpu-gloo", "--batch-size", "4",
                 "-o", str(out), "--no-report"]) == 0
    return trace, str(trace_path), str(out)


def test_estimate_write_on_another_cluster_records_it(tmp_path):
    trace, trace_path, out = _plan(tmp_path)
    assert load_plan(out).frontier  # the search's answer, for cpu-gloo on 2 GPUs
    assert main(["estimate", trace_path, "--plan", out, "--profile", "h100-80gb", "--gpus", "4",
                 "--micro-batch", "2", "--write"]) == 0
    plan = load_plan(out)
    assert (plan.cluster.profile, plan.cluster.gpus, plan.mesh.world_size, plan.training.micro_batch) == (
        "h100-80gb", 4, 4, 2)
    # the prediction is the plan's own, on the cluster it names
    assert plan.predicted.peak_bytes == estimate(trace, plan, load_priced_profile("h100-80gb")).memory.peak_bytes
    assert plan.solver.method == "given" and "cpu-gloo for 2 GPUs" in plan.solver.status
    assert plan.solver.objective == plan.predicted.step_time_s
    assert (plan.frontier, plan.baselines, plan.layouts, plan.measurements) == ((), (), (), ())


def test_estimate_write_on_the_same_cluster_keeps_the_search(tmp_path):
    _, trace_path, out = _plan(tmp_path)
    before = json.loads(open(out).read())
    assert main(["estimate", trace_path, "--plan", out, "--write"]) == 0
    after = json.loads(open(out).read())
    assert after == before  # the same question, the same answer: nothing to drop
