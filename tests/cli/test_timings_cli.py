"""``--timings FILE`` on plan and estimate: the plan is priced from measured module times, records the
file in ``cluster.timings``, and estimate prices it the same way unless told otherwise (``--timings ''``).

Tier 1: hand-made timings of tests/models/cost_mlp.py's hand-written trace (no measurement, no ranks).
"""



from tests.execute import test_module_timings as tm  # noqa: E402

from shard_planner.cli.main import main  # noqa: E402
from shard_planner.cost import estimate  # noqa: E402
from shard_planner.plan import load_plan  # noqa: E402
from shard_planner.hardware.profile import load_priced_profile  # noqa: E402
from shard_planner.hardware.timings import save_timings  # noqa: E402


def _files(tmp_path):
    trace_path, timings_path = tmp_path / "trace.json", tmp_path / "timings.json"
    trace = tm.cost_mlp.analytic_trace()
    trace_path.write_text(trace.to_json())
    save_timings(tm._timings(), timings_path)
    return trace, str(trace_path), str(timings_path)


def test_plan_records_the_timings_and_is_priced_by_them(tmp_path, capsys):
    trace, trace_path, timings = _files(tmp_path)
    out = str(tmp_path / "plan.json")
    assert main(["plan", trace_path, "--gpus", "2", "--mem", "1GB", "--profile", "cpu-gloo", "--batch-size", "4",
                 "--timings", timings, "-o", out, "--no-report"]) == 0
    assert "compute from measured module times" in capsys.readouterr().out
    plan = load_plan(out)
    assert plan.cluster.timings == timings
    priced = estimate(trace, plan, load_priced_profile("cpu-gloo", timings)).time.step_time_s
    flops = estimate(trace, plan, load_priced_profile("cpu-gloo")).time.step_time_s
    assert plan.predicted.step_time_s == priced
    assert priced > 2 * flops  # the hand-made times are milliseconds; the FLOP model says microseconds

    assert main(["estimate", trace_path, "--plan", out]) == 0
    assert "compute from measured module times" in capsys.readouterr().out
    assert main(["estimate", trace_path, "--plan", out, "--timings", ""]) == 0
    assert "compute from measured module times" not in capsys.readouterr().out


def test_plan_without_timings_records_none(tmp_path):
    _, trace_path, _ = _files(tmp_path)
    out = str(tmp_path / "plan.json")
    assert main(["plan", trace_path, "--gpus", "2", "--mem", "1GB", "--profile", "cpu-gloo", "--batch-size", "4",
                 "-o", out, "--no-report"]) == 0
    assert load_plan(out).cluster.timings is None


def test_timings_of_another_model_is_one_line(tmp_path, capsys):
    _, trace_path, _ = _files(tmp_path)
    other = tmp_path / "other.json"
    save_timings(tm._timings(fingerprint="something-else"), other)
    code = main(["plan", trace_path, "--gpus", "2", "--mem", "1GB", "--profile", "cpu-gloo", "--batch-size", "4",
                 "--timings", str(other), "-o", str(tmp_path / "p.json"), "--no-report"])
    err = capsys.readouterr().err
    assert code != 0 and "different model" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()
