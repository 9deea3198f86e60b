"""benchmarks/gpu_allocator.py rehearsed on CPU (``measure --device cpu``): the tiny Llama's per-block plan,
predicted, run in one process per allocator mode (the mode in its environment, as on a GPU), the cap sweep's
runs, and the report, whose replay of the snapshot (here the simulation's own calls) must match the
simulation exactly. What only CUDA does (the history, the cap, the statistics) is not run here."""

import json
import pickle

import gpu_allocator  # noqa: E402
import pytest

from shard_planner.cost.allocator_replay import events_from_snapshot


@pytest.mark.multiprocess
def test_the_rehearsal_measures_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARD_PLANNER_SIZE", "tiny")
    assert gpu_allocator.main(["measure", "--device", "cpu", "--out", str(tmp_path), "--steps", "2"]) == 0
    folder = tmp_path / "per-block"
    case = json.loads((folder / "case.json").read_text())
    for stem, expandable in gpu_allocator.MODES.items():
        result = json.loads((folder / f"{stem}.json").read_text())
        assert result["allocator_conf"] == gpu_allocator.CONF[expandable]  # the process ran in its mode
        assert len(result["record"]["step_time_s"]) == 2
        with open(folder / f"snapshot-{stem}.pickle", "rb") as f:
            assert len(events_from_snapshot(pickle.load(f))) == case["prediction"]["modes"][stem]["events"]
    sweep = json.loads((folder / "expandable.json").read_text())["sweep"]  # the plan's mode only
    assert [r["label"] for r in sweep] == [f"x{f:g}" for f in gpu_allocator.FACTORS]  # --mem: the whole device
    assert all(r["status"] == "pass" and len(r["step_time_s"]) == 2 for r in sweep)
    assert json.loads((folder / "default.json").read_text())["sweep"] == []
    text = (tmp_path / "report.md").read_text()
    assert text.count("| +0 MiB |") == 2  # the replay is the simulation, in both modes
    assert "cap sweep (expandable; predicted smallest cap" in text and text.count("| pass |") == len(sweep)
