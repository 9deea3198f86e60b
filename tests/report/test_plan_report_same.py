"""The report ``plan`` writes is the report ``shard-planner report plan.json`` writes of the same plan
(report/__init__.py [Note: One rank's trace]): the same report.md and the same figures, for a
tensor-parallel plan (every per-unit figure one TP rank's), a fine-tuning plan and an accumulation plan."""

import pytest

from shard_planner.cli.main import main
from shard_planner.errors import PlanError
from shard_planner.plan import load_plan
from shard_planner.report import check_trace_rank
from shard_planner.trace import trace_model
from shard_planner.model.modelfile import load_model_file
from tests.paths import EXAMPLES

LLAMA = str(EXAMPLES / "llama.py")
PLANS = {
    "tensor parallel": [LLAMA, "--profile", "h100-80gb", "--tp", "2"],
    "fine-tuning": [str(EXAMPLES / "llama_lora.py"), "--profile", "h100-80gb", "--tp", "1"],
    "accumulation": [LLAMA, "--profile", "h100-80gb", "--tp", "1", "--batch-size", "8", "--global-batch", "256"],
}


def _reports(tmp_path, args) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """(the files of the report ``plan`` wrote, those of ``report plan.json``), by name."""
    out = tmp_path / "plan.json"
    assert main(["plan", *args, "--gpus", "8", "--mem", "40GB", "--time-limit", "0.5", "-o", str(out)]) == 0
    assert main(["report", str(out), "-o", str(tmp_path / "again")]) == 0
    return ({p.name: p.read_bytes() for p in (tmp_path / "plan.report").iterdir()},
            {p.name: p.read_bytes() for p in (tmp_path / "again").iterdir()})


@pytest.mark.parametrize("kind", PLANS)
def test_plan_writes_the_report_that_report_writes(kind, tmp_path):
    by_plan, by_report = _reports(tmp_path, PLANS[kind])
    assert sorted(by_plan) == sorted(by_report) and "units.png" in by_plan and "memory_timeline.png" in by_plan
    assert by_plan["report.md"].decode() == by_report["report.md"].decode()
    for name in by_plan:  # the figures: Agg renders the same figure data to the same bytes
        assert by_plan[name] == by_report[name], name
    plan = load_plan(tmp_path / "plan.json")
    text = by_plan["report.md"].decode()
    if kind == "tensor parallel":  # the units table is one rank's: half the model's parameters
        assert plan.mesh.tp == 2
        root = next(line for line in text.splitlines() if line.startswith("| &lt;root&gt; |"))
        full = trace_model(load_model_file(LLAMA), dtype="bfloat16").param_count
        assert f"| {full:,} |" not in root
    if kind == "accumulation":
        assert plan.training.accumulation_steps > 1
    if kind == "fine-tuning":
        assert "trainable params" in text


def test_a_trace_of_another_degree_is_refused(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", *PLANS["tensor parallel"], "--gpus", "8", "--mem", "40GB", "--time-limit", "0.5",
                 "--no-report", "-o", str(out)]) == 0
    whole = trace_model(load_model_file(LLAMA), dtype="bfloat16")  # every block at its full size
    with pytest.raises(PlanError, match="the trace holds one rank at no tensor parallelism where the plan runs TP 2"):
        check_trace_rank(load_plan(out), whole)
    assert main(["trace", LLAMA, "-o", str(tmp_path / "trace.json")]) == 0  # one rank at degree 1
    assert main(["report", str(out), "--trace", str(tmp_path / "trace.json"), "-o", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists()
