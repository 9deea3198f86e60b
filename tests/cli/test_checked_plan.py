"""Every command that reads a plan checks it against its model in one place (shard_planner/load/checked_plan.py,
[Note: A plan checked against its model]) before any process starts or anything is traced, and says the
same line (issue 36, items 2 and 6):

- a model file with a size switch (SHARD_PLANNER_SIZE) set differently from when the plan was made: `run`
  failed in a rank ("names modules this model does not have"), `report` and `estimate` on a tensor-parallel
  style, `export --to fsdp2|torchtitan` wrote a file silently;
- a hand-edited plan with TP 4 on the tiny Llama (2 key/value heads): `run` started 4 ranks and failed in a
  reshape where `plan` says "heads 2, which 4 does not divide";
- `run` on CPU compares the ranks' host memory with what the machine has before launching
  (execute/host_memory.py [Note: A CPU run's host memory]), and names a rank killed by SIGKILL as likely
  out of host memory.
"""

from __future__ import annotations

import pytest

from shard_planner.cli.main import main
from shard_planner.errors import RunError
from shard_planner.execute import launch
from shard_planner.plan import save_plan
from tests.cli.test_bad_input import one_error_line, plan_failing_in_rank1, tiny_plan
from tests.ecosystem.conftest import llama_size
from tests.paths import EXAMPLES
from tests.report.tp_plans import llama_tp_plan

PLAN_ARGS = ["--gpus", "2", "--mem", "1GB", "--profile", "cpu-gloo", "--dtype", "fp32", "--time-limit", "1",
             "--no-report"]
COMMANDS = (["run", "{plan}", "--device", "cpu"], ["report", "{plan}", "-o", "{tmp}/rep"],
            ["estimate", str(EXAMPLES / "llama.py"), "--plan", "{plan}"],
            *(["export", "{plan}", "--to", to, "-o", f"{{tmp}}/out.{to}"]
              for to in ("fsdp2", "torchtitan", "accelerate", "deepspeed")))


def _every_command_says(tmp_path, capsys, plan_path, want: str) -> None:
    """Each of COMMANDS on ``plan_path`` exits 2 with the one line ``want`` and writes nothing."""
    before = sorted(tmp_path.iterdir())
    for command in COMMANDS:
        args = [a.format(plan=plan_path, tmp=tmp_path) for a in command]
        assert main(args) == 2, args
        assert one_error_line(capsys) == want, args
        assert sorted(tmp_path.iterdir()) == before, args


def test_a_model_of_another_size_is_one_line_in_every_command(tmp_path, monkeypatch, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["plan", str(EXAMPLES / "llama.py"), "-o", str(plan_path), *PLAN_ARGS]) == 0  # tiny
    capsys.readouterr()
    monkeypatch.setenv("SHARD_PLANNER_SIZE", "1b")  # set differently from when the plan was made
    _every_command_says(tmp_path, capsys, plan_path, (
        f"{plan_path}: {EXAMPLES / 'llama.py'} is not the model the plan was made for (fingerprint "
        f"{_fingerprint('1b')}, the plan's {_fingerprint('tiny')}): likely a size switch in the model file, e.g. "
        "SHARD_PLANNER_SIZE, set differently from when the plan was made (here: SHARD_PLANNER_SIZE=1b), or a "
        "changed file; set it as it was then, or re-run shard-planner plan"))


def test_a_tensor_parallel_degree_the_heads_refuse_is_refused_before_any_rank(tmp_path, capsys):
    plan_path = tmp_path / "tp4.json"
    save_plan(llama_tp_plan("tiny", shard=1, tp=4), plan_path)  # TP 4 on 2 key/value heads, by hand
    _every_command_says(tmp_path, capsys, plan_path, (
        f"{plan_path}: tensor parallelism of degree 4: layers.0.attention.wk holds attention heads of head_dim 16: "
        "heads 2, which 4 does not divide; choose a tp degree that divides it"))


def test_a_group_that_is_not_contiguous_siblings_is_refused_before_any_rank(tmp_path, monkeypatch, capsys):
    """apply_plan's group check, made before launching (a hand-edited plan used to fail in every rank)."""
    from dataclasses import replace

    from shard_planner.execute import runner
    from shard_planner.plan import Unit

    monkeypatch.setattr(runner, "launch_local", lambda *a, **k: pytest.fail("ranks were launched"))
    plan = tiny_plan()
    plan_path = tmp_path / "plan.json"
    save_plan(replace(plan, units=(plan.units[0], Unit(("blocks.0", "blocks.2")))), plan_path)
    assert main(["run", str(plan_path), "--device", "cpu"]) == 2
    assert one_error_line(capsys) == (f"{plan_path}: unit blocks.0..blocks.2: grouped modules must be a contiguous "
                                      "run of siblings in registration order (siblings without parameters aside), "
                                      "got positions [0, 2]")


def _fingerprint(size: str) -> str:
    """The structural fingerprint of examples/llama.py at ``size``."""
    import torch

    from shard_planner.model.modelfile import load_model_file
    from shard_planner.trace.structure import model_fingerprint

    with llama_size(size), torch.device("meta"):
        return model_fingerprint(load_model_file(str(EXAMPLES / "llama.py")).build())


# ---- host memory ----

def test_run_refuses_ranks_that_cannot_fit_in_host_memory(tmp_path, monkeypatch, capsys):
    plan_path = tmp_path / "plan.json"
    save_plan(tiny_plan(), plan_path)
    monkeypatch.setattr(launch, "available_host_bytes", lambda: 1000, raising=False)  # a machine with 1000 bytes free
    assert main(["run", str(plan_path), "--device", "cpu", "--no-checkpoint"]) == 4  # a RunError, as a run failing
    err = one_error_line(capsys)
    assert err.startswith("the 2 CPU rank(s) need at least ") and err.endswith(
        "but this machine has 1000 B available: run fewer ranks (--world-size), a smaller model, or on GPUs"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no measurement


def test_available_host_bytes_reads_meminfo_and_a_cgroup_limit(tmp_path):
    from shard_planner.execute import host_memory

    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:    2000000 kB\n")
    assert host_memory.available_host_bytes(proc, cgroup) == 2_000_000 * 1024  # no cgroup files: no limit
    (cgroup / "memory").mkdir(parents=True)  # v1, no limit
    (cgroup / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (cgroup / "memory" / "memory.usage_in_bytes").write_text("100\n")
    assert host_memory.available_host_bytes(proc, cgroup) == 2_000_000 * 1024
    (cgroup / "memory.max").write_text("1073741824\n")  # v2: a 1 GiB limit, 0.25 GiB used
    (cgroup / "memory.current").write_text("268435456\n")
    assert host_memory.available_host_bytes(proc, cgroup) == 805306368
    (cgroup / "memory.max").write_text("max\n")
    assert host_memory.available_host_bytes(proc, cgroup) == 2_000_000 * 1024
    assert host_memory.available_host_bytes(tmp_path / "none", cgroup) is None


def test_a_rank_needs_the_model_as_built_or_the_predicted_peak():
    from dataclasses import replace

    from shard_planner.execute import host_memory
    from shard_planner.plan import Prediction

    plan = tiny_plan()
    assert host_memory.rank_need_bytes(plan, 100, 2) == 100  # no prediction
    predicted = replace(plan, predicted=Prediction(5000, 1.0, {"overhead": 1000, "activations": 4000}, 1.0))
    assert host_memory.rank_need_bytes(predicted, 100, 2) == 4000  # the peak without the GPU's overhead
    assert host_memory.rank_need_bytes(predicted, 100, 4) == 100  # re-derived: the prediction does not apply


@pytest.mark.multiprocess
def test_a_rank_killed_by_sigkill_is_named_as_likely_out_of_host_memory(tmp_path):
    from shard_planner.execute import launch_plans

    plan = plan_failing_in_rank1(tmp_path, "killed_in_rank1.py",
                                 "os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does")
    with pytest.raises(RunError) as info:
        launch_plans([plan], steps=1, warmup=0, device="cpu", timeout_s=120)
    msg = str(info.value)
    assert msg.startswith("rank 1 was killed by SIGKILL during 'build': likely out of host memory: the kernel's OOM "
                          "killer sends SIGKILL; the 2 ranks need at least "), msg
