"""``run --checkpoint``: a distributed checkpoint saved after the measured steps restores, at the same world
size and at another one, every tensor bit for bit and the next steps' losses; a damaged checkpoint is
refused in one line with a non-zero exit, nothing written and no rank left running."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from shard_planner.cli.main import main as cli_main
from shard_planner.execute.checkpoint_dir import SIDE_FILE
from shard_planner.plan.measurement import load_measurement
from shard_planner.plan import Unit, save_plan
from tests.execute.test_run import make_plan, reference_losses
from tests.paths import MODELS

BLOCKS = [f"blocks.{i}" for i in range(6)]
STEPS_AFTER = 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One run at 2 ranks keeping its checkpoint, restored at 2 and (second launch) at 4 ranks."""
    tmp = tmp_path_factory.mktemp("ckpt")
    plan = make_plan([Unit(("",), False), Unit(("blocks.0", "blocks.1"), True, True),
                      *(Unit((b,)) for b in BLOCKS[2:]), Unit(("head",))], 2, model=str(MODELS / "exec_net.py"))
    save_plan(plan, tmp / "plan.json")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["run", str(tmp / "plan.json"), "--steps", "1", "--warmup", "1", "--device", "cpu",
                         "--timeout", "240", "--checkpoint-dir", str(tmp / "kept"), "--checkpoint-reshard-to", "4",
                         "--checkpoint-steps", str(STEPS_AFTER)])
    return dict(code=code, out=out.getvalue(), plan=plan, plan_path=tmp / "plan.json", dir=tmp / "kept")


def _files(directory: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir())}


def _ranks_running(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (the checkpoint folder a restore reads)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@pytest.mark.multiprocess
def test_restores_every_tensor_and_the_next_losses_at_2_and_at_4_ranks(saved):
    assert saved["code"] == 0, saved["out"]
    m = load_measurement(saved["plan_path"].with_name("measurement.json"))
    c = m.checkpoint
    assert c.ok and c.directory == str(saved["dir"]) and c.world_size == 2
    assert [r.world_size for r in c.restores] == [2, 4]
    same, other = c.restores
    assert same.loss_tolerance_rel == 0 and same.losses_restored == same.losses_uninterrupted  # bit for bit
    assert other.max_loss_diff_rel <= other.loss_tolerance_rel == 1e-5
    for r in c.restores:
        assert r.tensors_checked > 100 and r.tensors_differing == () and len(r.losses_restored) == STEPS_AFTER
        assert r.load_s > 0
    # The uninterrupted run took the steps after saving: they are the single-process run's steps there.
    ref = reference_losses(saved["plan"], 2, c.saved_at_step + STEPS_AFTER)
    assert list(same.losses_uninterrupted) == pytest.approx(ref[c.saved_at_step:], rel=1e-5)
    assert c.saved_at_step == len(m.losses)  # warm-up + timed + the storage-tracked step
    dcp_bytes = sum(len(b) for name, b in _files(saved["dir"]).items() if name != SIDE_FILE)
    assert c.size_bytes == dcp_bytes and c.save_s > 0 and c.save_extra_peak_bytes > 0
    assert "restore verified on 2 ranks" in saved["out"] and "restore verified on 4 ranks" in saved["out"]
    assert "extra peak memory while saving" in saved["out"]


@pytest.mark.multiprocess
def test_resume_from_a_kept_checkpoint_at_1_rank_reads_and_writes_nothing(saved, capsys):
    before = _files(saved["dir"])
    code = cli_main(["run", str(saved["plan_path"]), "--resume-from", str(saved["dir"]), "--world-size", "1",
                     "--device", "cpu", "--timeout", "120"])
    assert code == 0
    assert "restore verified on 1 rank:" in capsys.readouterr().out
    assert _files(saved["dir"]) == before


def _truncate_a_shard(d: Path) -> None:
    shard = sorted(d.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])


def _delete_metadata(d: Path) -> None:
    (d / ".metadata").unlink()


def _garbage_in_a_shard(d: Path) -> None:
    shard = sorted(d.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 4096] = b"\x13" * 4096
    shard.write_bytes(bytes(data))


def _change_a_saved_digest(d: Path) -> None:
    record = json.loads((d / SIDE_FILE).read_text())
    key = sorted(record["digests"])[0]
    record["digests"][key] = "0" * 64
    (d / SIDE_FILE).write_text(json.dumps(record))


@pytest.mark.multiprocess
@pytest.mark.parametrize("damage, expect", [
    (_truncate_a_shard, "the checkpoint cannot be read"),
    (_delete_metadata, ".metadata file is missing"),
    (_garbage_in_a_shard, "the checkpoint cannot be read"),
    (_change_a_saved_digest, "state entries differ"),
])
def test_a_damaged_checkpoint_is_refused_in_one_line(saved, tmp_path, capsys, damage, expect):
    copy = tmp_path / f"damaged-{damage.__name__}"
    shutil.copytree(saved["dir"], copy)
    damage(copy)
    before = _files(copy)
    code = cli_main(["run", str(saved["plan_path"]), "--resume-from", str(copy), "--device", "cpu",
                     "--timeout", "120"])
    captured = capsys.readouterr()
    assert code != 0
    lines = (captured.err + captured.out).strip().splitlines()
    message = [line for line in lines if expect in line]
    assert len(message) == 1, lines
    assert "Traceback" not in captured.err + captured.out
    assert _files(copy) == before  # nothing written into it
    assert _ranks_running(str(copy)) == []


def test_a_checkpoint_folder_that_is_not_empty_is_refused_before_the_run(tmp_path, capsys):
    plan = make_plan([Unit(("",), False), *(Unit((b,)) for b in BLOCKS)], 2, model=str(MODELS / "exec_net.py"))
    save_plan(plan, tmp_path / "plan.json")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    code = cli_main(["run", str(tmp_path / "plan.json"), "--device", "cpu", "--checkpoint-dir", str(tmp_path / "full")])
    captured = capsys.readouterr()
    assert code != 0 and "not empty" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "running" not in captured.out  # refused before any rank starts
    assert os.listdir(tmp_path / "full") == ["keep.txt"] and not (tmp_path / "measurement.json").exists()


def test_no_checkpoint_passes_none_and_checkpoint_is_the_default(tmp_path, monkeypatch):
    import shard_planner.execute.runner as runner

    seen = []

    def fake_run_plan_file(path, **kwargs):
        seen.append(kwargs["checkpoint"])
        raise runner.RunError("stop here")

    monkeypatch.setattr(runner, "run_plan_file", fake_run_plan_file)
    plan = make_plan([Unit(("",), False), *(Unit((b,)) for b in BLOCKS)], 2, model=str(MODELS / "exec_net.py"))
    save_plan(plan, tmp_path / "plan.json")
    cli_main(["run", str(tmp_path / "plan.json"), "--device", "cpu", "--no-checkpoint"])
    cli_main(["run", str(tmp_path / "plan.json"), "--device", "cpu", "--checkpoint-reshard-to", "1"])
    assert seen[0] is None
    assert seen[1].directory is None and seen[1].reshard_to == 1 and seen[1].steps == 2


@pytest.mark.multiprocess
def test_restore_with_gradient_accumulation_at_2_and_at_4_ranks(tmp_path):
    """Two micro-steps per optimizer step, gradients synced on the last: the restored runs take whole
    optimizer steps, each micro-step's global micro-batch regrouped at 4 ranks."""
    plan = make_plan([Unit(("",), False), *(Unit((b,)) for b in BLOCKS)], 2, model=str(MODELS / "exec_net.py"),
                     accumulation_steps=2, gradient_sync="last_micro_step", keep_params_gathered=True)
    save_plan(plan, tmp_path / "plan.json")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["run", str(tmp_path / "plan.json"), "--steps", "1", "--warmup", "1", "--device", "cpu",
                         "--timeout", "240", "--checkpoint-reshard-to", "4", "--checkpoint-steps", str(STEPS_AFTER)])
    assert code == 0, out.getvalue()
    c = load_measurement(tmp_path / "measurement.json").checkpoint
    same, other = c.restores
    assert c.ok and same.losses_restored == same.losses_uninterrupted
    assert other.max_loss_diff_rel <= other.loss_tolerance_rel and other.tensors_differing == ()
