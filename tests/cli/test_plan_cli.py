"""`shard-planner plan`: the CLI writes a plan per the contract, prints the summary, and turns bad
input and infeasible budgets into one line and a non-zero exit."""

import json

import pytest

from shard_planner.cli.main import main
from shard_planner.plan import MEMORY_CATEGORIES, load_plan
from tests.paths import EXAMPLES

GPT2 = str(EXAMPLES / "gpt2.py")


@pytest.fixture(scope="module")
def trace_json(tmp_path_factory):
    """Trace once; the other tests plan from the trace.json (the CLI accepts either)."""
    from shard_planner.trace import trace_model

    path = tmp_path_factory.mktemp("trace") / "trace.json"
    path.write_text(trace_model(GPT2).to_json())
    return str(path)


def test_plan_writes_the_contract_and_a_summary(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", GPT2, "--gpus", "8", "--mem", "2GB", "-o", str(out), "--no-report", "--time-limit", "1"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "predicted peak" in text and "of 1.89 GiB usable" in text and "--mem 2.00 GiB less the 5.3% margin" in text
    assert "predicted step" in text and "on the GPU: fits 2.00 GiB" in text and "reserved peak" in text
    assert "solver: " in text and f"wrote {out}" in text
    d = json.loads(out.read_text())
    for key in ("schema_version", "model", "cluster", "training", "units", "prefetch", "predicted", "solver",
                "frontier", "baselines"):
        assert key in d
    assert d["cluster"]["mem_budget_bytes"] == 2 * 2**30 and d["cluster"]["gpus"] == 8
    assert set(d["predicted"]["memory_at_peak"]) <= set(MEMORY_CATEGORIES)
    assert d["predicted"]["peak_bytes"] <= 2 * 2**30
    assert d["model"]["fingerprint"] and d["units"][0]["modules"] == [""]
    plan = load_plan(out)
    assert plan.solver.seconds > 0 and plan.frontier and plan.baselines
    assert not list(tmp_path.glob(".*tmp")), "atomic write left a temporary file"


def test_plan_from_trace_json_search_batch(trace_json, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", trace_json, "--gpus", "4", "--mem", "2GB", "--search-batch", "-o", str(out),
                 "--no-report", "--time-limit", "1"]) == 0
    plan = load_plan(out)
    assert plan.training.micro_batch >= 1 and plan.predicted.peak_bytes <= 2 * 2**30


def test_infeasible_budget_exits_3_with_one_line(trace_json, tmp_path, capsys):
    rc = main(["plan", trace_json, "--gpus", "2", "--mem", "1MB", "-o", str(tmp_path / "p.json"),
               "--profile", "cpu-gloo", "--no-report", "--time-limit", "1"])
    err = capsys.readouterr().err
    assert rc == 3
    assert err.startswith("shard-planner: error: no plan fits 1.00 MiB") and err.count("\n") == 1
    assert "smallest budget any plan needs is" in err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0", "--mem", "40GB"], "--gpus must be a positive integer"),
    (["--gpus", "8", "--mem", "forty"], "--mem must be a positive memory size such as 40GB, 80GiB or 512MB, got 'forty'"),
    (["--gpus", "8", "--mem", "40GB", "--profile", "nope"], "no profile 'nope'"),
    (["--gpus", "8", "--mem", "40GB", "--batch-size", "0"], "--batch-size must be a positive integer"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    rc = main(["plan", GPT2, *argv, "--no-report"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def test_plan_with_report_runs_the_cost_model_once_for_the_timeline(trace_json, tmp_path, capsys, monkeypatch):
    """The report draws the planner's estimate of the chosen plan (PlanResult.estimate): the only
    estimate with a memory timeline in the whole command is the planner's own; the time line says
    where the time went."""
    from shard_planner.cost.model import CostModel  # the planner holds one; the wrappers build one per call

    timelines = []
    real = CostModel.estimate

    def counting(self, plan, *, timeline=True):
        timelines.append(timeline)
        return real(self, plan, timeline=timeline)

    monkeypatch.setattr(CostModel, "estimate", counting)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", trace_json, "--gpus", "8", "--mem", "2GB", "-o", "p.json", "--time-limit", "1"]) == 0
    text = capsys.readouterr().out
    assert timelines.count(True) == 1 and len(timelines) > 1
    assert (tmp_path / "p.report" / "report.html").exists() and "memory_timeline.png" in (
        tmp_path / "p.report" / "report.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("time: "))
    for stage in ("trace", "screen", "solve", "frontier", "polish", "report", "CP-SAT", "simulators"):
        assert stage in line


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`shard-planner plan ... | head -1`: the reader closes the pipe; the plan file is written before
    the summary, and the command ends quietly with 128 + SIGPIPE, as a shell tool does."""
    import signal
    import subprocess
    import sys

    from tests.paths import REPO

    proc = subprocess.Popen([sys.executable, "-m", "shard_planner.cli.main", "plan", str(EXAMPLES / "gpt2.py"),
                             "--gpus", "2", "--mem", "2GB", "--profile", "cpu-gloo", "--no-report",
                             "-o", str(tmp_path / "plan.json")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command prints anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert load_plan(tmp_path / "plan.json").units
