"""Where a plan's files are: the plan records its model file as an absolute path and relative to the plan
(so run/export/report find it from any folder, and after the plan and its model moved together); a plan
made from a trace.json records the trace's model file and its TRAINING defaults; the report goes beside
the plan; plan files written before ``relative_path`` still load and resolve."""

import json
import shutil
from dataclasses import replace

import pytest

from shard_planner.cli.main import main
from shard_planner.errors import PlanError
from shard_planner.plan.measurement import plan_fingerprint
from shard_planner.plan import Plan, load_plan, report_dir_for, resolve_model_file
from tests.paths import MODELS

PLAN_ARGS = ["--gpus", "2", "--mem", "1GB", "--profile", "cpu-gloo", "--dtype", "fp32", "--time-limit", "1"]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """tmp/proj/models/net.py (the executor's test model, TRAINING micro_batch 4); the cwd is tmp/proj."""
    root = tmp_path / "proj"
    (root / "models").mkdir(parents=True)
    shutil.copy(MODELS / "exec_net.py", root / "models" / "net.py")
    monkeypatch.chdir(root)
    return root


def test_plan_records_the_model_absolute_and_relative_and_reports_beside_it(project, tmp_path, monkeypatch):
    """Two plans named plan.json in two folders keep two reports, each beside its plan."""
    for folder in ("a", "b"):
        assert main(["plan", "models/net.py", "-o", f"{folder}/plan.json", *PLAN_ARGS]) == 0
    for folder in ("a", "b"):
        plan = load_plan(project / folder / "plan.json")
        assert plan.model.path == str((project / "models" / "net.py").resolve())
        written = json.loads((project / folder / "plan.json").read_text())["model"]  # load_plan resolves it
        assert written["relative_path"] == "../models/net.py" and written["path"] == plan.model.path
        assert (project / folder / "plan.report" / "report.html").is_file()
    assert not (project / "reports").exists()
    assert report_dir_for(project / "a" / "plan.json") == project / "a" / "plan.report"
    # where the model file lies is no decision: the measured plan is the same plan
    a, b = (load_plan(project / f / "plan.json") for f in ("a", "b"))
    assert plan_fingerprint(a) == plan_fingerprint(replace(a, model=replace(a.model, relative_path=None, path="x.py")))
    # --report-dir puts it elsewhere
    assert main(["plan", "models/net.py", "-o", "c/plan.json", "--report-dir", "elsewhere", *PLAN_ARGS]) == 0
    assert (project / "elsewhere" / "report.html").is_file() and not (project / "c" / "plan.report").exists()


def test_a_moved_project_still_finds_its_model_from_another_folder(project, tmp_path, monkeypatch, capsys):
    assert main(["plan", "models/net.py", "-o", "out/plan.json", "--no-report", *PLAN_ARGS]) == 0
    moved = tmp_path / "moved"
    shutil.move(project, moved)  # the absolute path recorded in the plan no longer exists
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    plan_path = moved / "out" / "plan.json"
    assert resolve_model_file(load_plan(plan_path).model, plan_path) == str((moved / "models" / "net.py").resolve())
    capsys.readouterr()
    assert main(["export", str(plan_path), "--to", "accelerate", "-o", "acc.yaml"]) == 0
    assert (elsewhere / "acc.yaml").is_file()
    assert main(["report", str(plan_path)]) == 0
    assert (moved / "out" / "plan.report" / "report.html").is_file()


def test_a_plan_from_a_trace_json_records_the_model_file_and_its_training(project, capsys):
    assert main(["trace", "models/net.py", "--dtype", "fp32", "-o", "traces/trace.json"]) == 0
    trace = json.loads((project / "traces" / "trace.json").read_text())
    assert trace["training"]["micro_batch"] == 4
    assert main(["plan", "traces/trace.json", "-o", "out/plan.json", "--no-report", *PLAN_ARGS]) == 0
    plan = load_plan(project / "out" / "plan.json")
    assert plan.model.path == str((project / "models" / "net.py").resolve())  # never the trace.json
    assert json.loads((project / "out" / "plan.json").read_text())["model"]["relative_path"] == "../models/net.py"
    assert plan.training.micro_batch == 4  # TRAINING through the trace, not 1
    capsys.readouterr()
    assert main(["export", "out/plan.json", "--to", "accelerate"]) == 0  # built the model file, not the trace
    out = capsys.readouterr().out
    assert plan.model.path in out and "trace.json" not in out and "fsdp_version: 2" in out


def test_old_plan_files_without_relative_path_still_load_and_resolve(project, tmp_path, monkeypatch):
    """A plan written before relative_path: model.path relative to where `plan` ran (here: the project)."""
    assert main(["plan", "models/net.py", "-o", "plan.json", "--no-report", *PLAN_ARGS]) == 0
    d = json.loads((project / "plan.json").read_text())
    d["model"] = {k: v for k, v in d["model"].items() if k != "relative_path"}
    d["model"]["path"] = "models/net.py"
    (project / "old.json").write_text(json.dumps(d))
    plan = Plan.from_dict(d)  # as written
    assert plan.model.relative_path is None and plan.model.path == "models/net.py"
    monkeypatch.chdir(tmp_path)  # another folder: found beside the plan, as before
    want = str((project / "models" / "net.py").resolve())
    assert resolve_model_file(plan.model, project / "old.json") == want
    assert load_plan(project / "old.json").model.path == want  # load_plan resolves it
    assert resolve_model_file(plan.model) == "models/net.py"  # no plan file to look beside
    d["model"]["relative_path"] = 3  # the schema checks the new field like the others
    with pytest.raises(PlanError, match=r"^model\.relative_path must be a string or null, got 3$"):
        Plan.from_dict(d)


@pytest.mark.multiprocess
def test_run_from_another_folder(project, tmp_path, monkeypatch, capsys):
    assert main(["plan", "models/net.py", "-o", "out/plan.json", "--no-report", *PLAN_ARGS]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["run", str(project / "out" / "plan.json"), "--device", "cpu", "--steps", "1", "--warmup", "0"]) == 0
    assert (project / "out" / "measurement.json").is_file()
