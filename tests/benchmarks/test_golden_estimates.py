"""benchmarks/golden_estimates.py cannot rot: its check mode passes against a dump it has just written
(the tiny corpus: hand-written traces, no tracing, no planner), and a changed number is found by path."""

import json

import golden_estimates as golden  # noqa: E402


def test_check_passes_against_a_fresh_dump(tmp_path, capsys):
    out = tmp_path / "golden.json"
    assert golden.main(["--tiny", "--out", str(out)]) == 0
    assert golden.main(["--tiny", "--check", str(out)]) == 0
    assert "identical" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    row = doc["estimates"]["solve_traces.stack_trace(4)"]["test-gpu"]["per-block reshard"]
    assert row["estimate"]["memory"]["timeline"], "the memory timeline is recorded"
    assert row["fresh_model_equal"] is True


def test_first_difference_names_the_path():
    a = {"x": [1, {"y": 0.1}], "z": "s"}
    b = json.loads(json.dumps(a))
    assert golden.first_difference(a, b) is None
    b["x"][1]["y"] = 0.1 + 2e-16  # the next float: canonical JSON tells them apart
    assert golden.first_difference(a, b).startswith("$.x[1].y:")
    assert golden.first_difference({"k": 1}, {"k": 1.0}).startswith("$.k: int")
    assert "only in" in golden.first_difference({"k": 1}, {})
