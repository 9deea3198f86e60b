"""Every file a plan records resolves the same way (shard_planner/plan/paths.py, [Note: Paths in a plan
file]): the module timings (``--timings``) and a profile given as a TOML path are recorded, like the model
file, as absolute paths and relative to the plan file, so ``estimate`` and ``report`` find them from any
folder and after the project moved (issue 36, item 4: ``--timings cal/timings.json`` was recorded relative
to the folder ``plan`` ran in; ``estimate`` from another folder failed and ``report`` exited 0 with the
error pasted into its cluster row and no memory timeline)."""

import shutil

from tests.execute import test_module_timings as tm

from shard_planner.cli.main import main
from shard_planner.plan import load_plan
from shard_planner.hardware.profile import PROFILES_DIR
from shard_planner.hardware.timings import save_timings


def _project(root):
    """root/traces/trace.json (tests/models/cost_mlp.py's hand-written trace), root/cal/timings.json (hand-made
    times of it) and root/prof/box.toml (a copy of the cpu-gloo profile)."""
    for sub in ("traces", "cal", "prof"):
        (root / sub).mkdir(parents=True)
    (root / "traces" / "trace.json").write_text(tm.cost_mlp.analytic_trace().to_json())
    save_timings(tm._timings(), root / "cal" / "timings.json")
    shutil.copy(PROFILES_DIR / "cpu-gloo.toml", root / "prof" / "box.toml")


def test_timings_and_profile_paths_resolve_beside_the_plan_from_any_folder(tmp_path, monkeypatch, capsys):
    project = tmp_path / "proj"
    _project(project)
    monkeypatch.chdir(project)
    assert main(["plan", "traces/trace.json", "--gpus", "2", "--mem", "1GB", "--profile", "prof/box.toml",
                 "--batch-size", "4", "--timings", "cal/timings.json", "-o", "out/plan.json", "--no-report"]) == 0
    plan = load_plan("out/plan.json")  # read: absolute paths
    assert plan.cluster.timings == str((project / "cal" / "timings.json").resolve())
    assert plan.cluster.profile == str((project / "prof" / "box.toml").resolve())
    written = (project / "out" / "plan.json").read_text()  # written: relative to the plan file as well
    assert '"timings_relative_path": "../cal/timings.json"' in written
    assert '"profile_relative_path": "../prof/box.toml"' in written

    moved = tmp_path / "moved"
    shutil.move(project, moved)  # the absolute paths recorded no longer exist
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    plan_path, trace_path = str(moved / "out" / "plan.json"), str(moved / "traces" / "trace.json")
    assert load_plan(plan_path).cluster.timings == str((moved / "cal" / "timings.json").resolve())
    capsys.readouterr()
    assert main(["estimate", trace_path, "--plan", plan_path]) == 0
    out = capsys.readouterr().out
    assert "compute from measured module times" in out and "profile cpu-gloo" in out
    assert main(["report", plan_path, "--trace", trace_path, "-o", "rep"]) == 0
    md = (elsewhere / "rep" / "report.md").read_text()
    assert "module-timings" not in md and "cannot be loaded" not in md
    assert (elsewhere / "rep" / "memory_timeline.png").is_file()

    # a recorded file missing here is one line and no report, not a report without its timeline
    (moved / "cal" / "timings.json").unlink()
    capsys.readouterr()
    assert main(["report", plan_path, "--trace", trace_path, "-o", "rep2"]) == 2
    err = capsys.readouterr().err.strip()
    recorded = (project / "cal" / "timings.json").resolve()  # found nowhere: named as recorded
    assert err == f"shard-planner: error: {plan_path}: {recorded}: no such module-timings file"
    assert not (elsewhere / "rep2").exists()
