"""Bad input and bad places: every error is one line, nothing is half-written.

- output places: checked before the work starts by every command that writes (one line, exit 2);
- writes are atomic: concurrent writers leave one whole file, an interrupted one leaves the old file;
- a plan file's fields: type and range checked on load, named by their JSON path, by every command;
- a model file that exits or interrupts itself while imported or called;
- (multiprocess) a rank that dies without reporting; ``run`` interrupted by SIGINT / SIGTERM.

Tests run as root in CI, where permission bits do not stop a write: "not writable" is tested with a
parent that is a file, with a folder under /proc (no file can be created there, even by root), and with
``os.access`` monkeypatched to say no.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shard_planner import fileio
from shard_planner.cli.main import main
from shard_planner.errors import ModelFileError, PlanError, RunError
from shard_planner.fileio import OutputPathError, check_output_dir, check_output_file, write_atomic
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit, load_plan, save_plan
from tests.paths import MODELS, REPO as ROOT

EXEC_NET = MODELS / "exec_net.py"
BLOCKS = [f"blocks.{i}" for i in range(6)]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("shard-planner: error: "), err
    return err.removeprefix("shard-planner: error: ")


@functools.cache
def exec_net_fingerprint() -> str:
    from shard_planner.trace.structure import model_fingerprint

    return model_fingerprint(load_model_file(str(EXEC_NET)).build())


def tiny_plan(world_size: int = 2) -> Plan:
    """exec_net.py on ``world_size`` CPU ranks, one unit per block."""
    return Plan(ModelRef(str(EXEC_NET), exec_net_fingerprint()), Cluster(world_size, 8, "cpu-gloo", 2**30),
                Mesh(shard=world_size), Training(4, param_dtype="float32"),
                (Unit(("",), False), *(Unit((b,)) for b in BLOCKS)), Prefetch(0, 1))


def plan_failing_in_rank1(tmp_path: Path, name: str, statement: str) -> Plan:
    """:func:`tiny_plan` of a copy of exec_net.py, written to ``tmp_path / name``, whose rank 1 runs
    ``statement`` (one line of Python, ``os`` and ``signal`` imported) while it builds the model."""
    model = tmp_path / name
    model.write_text(f"import os, signal, sys\nsys.path.insert(0, {str(EXEC_NET.parent)!r})\nimport exec_net\n"
                     "make_batch, loss_fn = exec_net.make_batch, exec_net.loss_fn\n"
                     "def build_model():\n"
                     "    if os.environ.get('RANK') == '1':\n"
                     f"        {statement}\n"
                     "    return exec_net.build_model()\n")
    from shard_planner.trace.structure import model_fingerprint

    fingerprint = model_fingerprint(load_model_file(str(model)).build())  # RANK is not 1 here
    return Plan.from_dict({**tiny_plan().to_dict(), "model": {"path": str(model), "fingerprint": fingerprint}})


# ---- output places ----

def test_output_under_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputPathError, match=r"cannot write the plan file: .*afile is a file, not a folder"):
        check_output_file(tmp_path / "afile" / "deeper" / "plan.json", "plan")
    with pytest.raises(OutputPathError, match="cannot write the report folder: it is a file"):
        check_output_dir(tmp_path / "afile", "report")
    with pytest.raises(OutputPathError, match="cannot write the trace file: it is a folder"):
        check_output_file(tmp_path, "trace")


def test_output_in_missing_folders_is_fine_and_creates_nothing(tmp_path):
    check_output_file(tmp_path / "a" / "b" / "plan.json")
    check_output_dir(tmp_path / "c" / "report")
    assert list(tmp_path.iterdir()) == []  # no folder, no probe file left behind


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_output_where_nothing_can_be_created_even_by_root():
    with pytest.raises(OutputPathError, match=r"/proc is not writable"):
        check_output_file("/proc/shard-planner-plan.json", "plan")


def test_output_in_a_folder_without_write_permission(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio.os, "access", lambda path, mode: False)  # as for a user without write access
    with pytest.raises(OutputPathError, match=r"is not writable \(permission denied\)"):
        check_output_file(tmp_path / "plan.json", "plan")


def test_write_atomic_under_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputPathError, match="afile is a file, not a folder"):
        write_atomic(tmp_path / "afile" / "plan.json", "{}")


def _cli(*argv):
    return main([str(a) for a in argv])


def _output_cases(tmp_path: Path) -> dict[str, list]:
    """Per command that writes: arguments whose only usable output place is under a regular file. The
    inputs are missing or wrong too, so an error about the output proves it is checked first."""
    bad = tmp_path / "afile" / "out"
    plan = tmp_path / "plan.json"
    return {
        "trace -o": ["trace", tmp_path / "missing.py", "-o", bad / "t.json"],
        "plan -o": ["plan", tmp_path / "missing.py", "--gpus", "2", "--mem", "1GB", "--profile", "nope", "-o",
                    bad / "p.json"],
        "plan report dir": ["plan", tmp_path / "missing.py", "--gpus", "2", "--mem", "1GB", "--profile", "nope",
                            "-o", tmp_path / "afile.json"],  # afile.report/ beside it: made a file below
        "estimate --write": ["estimate", tmp_path / "missing.py", "--plan", tmp_path / "readonly" / "plan.json",
                             "--write"],
        "export -o": ["export", tmp_path / "missing.json", "--to", "fsdp2", "-o", bad / "x.py"],
        "report -o": ["report", tmp_path / "missing.json", "-o", tmp_path / "afile"],
        "run -o": ["run", plan, "-o", bad / "m.json", "--device", "cpu"],
        "calibrate -o": ["calibrate", "-o", bad / "p.toml"],
        "calibrate --model -o": ["calibrate", "--model", tmp_path / "missing.py", "-o", bad / "t.json"],
        "tune -o": ["tune", tmp_path / "missing.py", "--gpus", "2", "--mem", "1GB", "-o", bad / "p.json"],
        "tune --profile-out": ["tune", tmp_path / "missing.py", "--gpus", "2", "--mem", "1GB",
                               "-o", tmp_path / "p.json", "--profile-out", bad / "p.toml"],
        "tune --report": ["tune", tmp_path / "missing.py", "--gpus", "2", "--mem", "1GB",
                          "-o", tmp_path / "p.json", "--report", tmp_path / "afile"],
    }


@pytest.mark.parametrize("case", list(_output_cases(Path("/x"))))
def test_every_writing_command_checks_its_output_first(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "afile.report").write_text("x")  # plan's report folder, <plan name>.report/ beside the plan
    save_plan(tiny_plan(), tmp_path / "plan.json")
    (tmp_path / "readonly").mkdir()
    save_plan(tiny_plan(), tmp_path / "readonly" / "plan.json")
    if case == "estimate --write":  # the plan file's folder cannot be written
        monkeypatch.setattr(fileio.os, "access", lambda path, mode: Path(path) != tmp_path / "readonly")
    assert _cli(*_output_cases(tmp_path)[case]) == 2
    line = one_error_line(capsys)
    assert "cannot write the" in line and ("is a file" in line or "not writable" in line), line


def test_trace_to_a_bad_place_writes_nothing_and_says_so_before_tracing(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert _cli("trace", EXEC_NET, "-o", tmp_path / "afile" / "t.json") == 2
    assert one_error_line(capsys) == f"{tmp_path / 'afile' / 't.json'}: cannot write the trace file: " \
                                     f"{tmp_path / 'afile'} is a file, not a folder"
    assert (tmp_path / "afile").read_text() == "x"


# ---- atomic writes ----

def test_concurrent_writers_leave_one_whole_file(tmp_path):
    path = tmp_path / "plan.json"
    payloads = [json.dumps({"writer": w, "pad": str(w) * 300_000}) for w in range(4)]
    seen, stop = [], threading.Event()

    def writer(text):
        for _ in range(15):
            write_atomic(path, text)

    def reader():
        while not stop.is_set():
            if path.exists():
                seen.append(path.read_text())

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert path.read_text() in payloads
    assert seen and all(text in payloads for text in seen)  # never a mixed or partial file
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left


def test_an_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    write_atomic(path, "old")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(fileio.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["plan.json"]


# ---- the plan file ----

def _bad_plan_cases():
    """(what to change in a good plan's JSON, the message naming the field)."""
    def set_(path, value):
        def change(d):
            *parents, last = path
            for key in parents:
                d = d[key]
            d[last] = value
        return change

    return [
        (set_(("units", 3, "activation_checkpoint"), "yes"),
         'units[3].activation_checkpoint must be true, false or "selective", got "yes"'),
        (set_(("units", 1, "reshard_after_forward"), 1),
         "units[1].reshard_after_forward must be true, false or an integer >= 2, got 1"),
        (set_(("units", 1, "reshard_after_forward"), "false"),
         'units[1].reshard_after_forward must be true, false or an integer >= 2, got "false"'),
        (set_(("units", 2, "modules"), "blocks.1"), 'units[2].modules must be a list, got "blocks.1"'),
        (set_(("units", 2, "modules"), ["blocks.1", 7]), "units[2].modules[1] must be a string, got 7"),
        (set_(("units", 2, "modules"), []), "units[2].modules must have at least 1 item, got []"),
        (set_(("units", 2), "blocks.1"), 'units[2] must be a JSON object, got "blocks.1"'),
        (set_(("units",), {}), "units must be a list, got {}"),
        (set_(("prefetch", "forward"), -1), "prefetch.forward must be an integer from 0 to 8, got -1"),
        (set_(("prefetch", "backward"), 1.5), "prefetch.backward must be an integer from 0 to 8, got 1.5"),
        (set_(("training", "micro_batch"), 0), "training.micro_batch must be a positive integer, got 0"),
        (set_(("training", "cpu_offload"), "no"), 'training.cpu_offload must be true or false, got "no"'),
        (set_(("training", "lr"), -0.1), "training.lr must be a positive number, got -0.1"),
        (set_(("training", "param_dtype"), "fp8"),
         'training.param_dtype must be one of "float32", "bfloat16", "float16", got "fp8"'),
        (set_(("cluster", "gpus"), "2"), 'cluster.gpus must be a positive integer, got "2"'),
        (set_(("cluster", "gpus_per_node"), 0), "cluster.gpus_per_node must be a positive integer, got 0"),
        (set_(("cluster", "mem_budget_bytes"), None), "cluster.mem_budget_bytes must be a positive integer, got null"),
        (set_(("mesh", "shard"), True), "mesh.shard must be a positive integer, got true"),
        (set_(("mesh", "replicate"), 0), "mesh.replicate must be a positive integer, got 0"),
        (set_(("model", "path"), 3), "model.path must be a string, got 3"),
        (set_(("units", 1, "reshard_after_forward"), 3),  # a check across fields (the mesh), in __post_init__
         "units[1] (unit blocks.0): reshard_after_forward=3 must divide the shard group size 2 and be smaller than it"),
        (set_(("units", 2, "modules"), ["blocks.0"]), "units[2]: module ['blocks.0'] is in two units"),
    ]


@pytest.mark.parametrize("change, message", _bad_plan_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_bad_field_is_named_by_its_json_path(change, message, tmp_path):
    d = json.loads(tiny_plan().to_json())
    change(d)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert str(info.value) == f"{path}: {message}"


def test_unknown_and_missing_fields_name_their_section():
    d = json.loads(tiny_plan().to_json())
    d["units"][2]["wrap"] = True
    with pytest.raises(PlanError, match=r'^units\[2\] is a malformed section: unknown field "wrap"'):
        Plan.from_dict(d)
    d = json.loads(tiny_plan().to_json())
    del d["training"]["micro_batch"]
    with pytest.raises(PlanError, match=r"^training is missing the field 'micro_batch'$"):
        Plan.from_dict(d)
    d = json.loads(tiny_plan().to_json())
    del d["schema_version"]
    with pytest.raises(PlanError, match="no schema_version"):
        Plan.from_dict(d)


def test_good_plans_still_load(tmp_path):
    for path in sorted((ROOT / "reports" / "examples").glob("*/plan.json")):
        plan = load_plan(path)
        assert Plan.from_dict(json.loads(plan.to_json())) == plan == Plan.from_dict(plan.to_dict())


def _plan_reading_commands(plan: Path) -> dict[str, list]:
    return {
        "run": ["run", plan, "--device", "cpu"],
        "export": ["export", plan, "--to", "fsdp2"],
        "report": ["report", plan, "--no-trace", "-o", plan.parent / "report"],
        "estimate": ["estimate", EXEC_NET, "--plan", plan],
    }


@pytest.mark.parametrize("command", list(_plan_reading_commands(Path("x"))))
def test_every_command_rejects_the_same_bad_plan_the_same_way(command, tmp_path, capsys):
    d = json.loads(tiny_plan().to_json())
    d["units"][3]["activation_checkpoint"] = "yes"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    assert _cli(*_plan_reading_commands(path)[command]) == PlanError.exit_code
    assert one_error_line(capsys) == f'{path}: units[3].activation_checkpoint must be true, false or "selective", got "yes"'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # nothing written


def test_a_folder_given_as_a_plan(tmp_path):
    with pytest.raises(PlanError, match="is a folder, expected a plan file"):
        load_plan(tmp_path)


# ---- the model file ----

MODEL_TAIL = """
import torch, torch.nn as nn
def build_model():
    return nn.Linear(4, 2)
def make_batch(b):
    return torch.randn(b, 4), torch.randint(0, 2, (b,))
"""


@pytest.mark.parametrize("text, message", [
    ("import sys\nsys.exit()\n", "importing it exited (sys.exit or exit): a model file must not exit"),
    ("exit(0)\n", "importing it exited (sys.exit(0) or exit(0)): a model file must not exit"),
    ("raise SystemExit('bye')\n", "importing it exited (sys.exit('bye') or exit('bye'))"),
    ("raise KeyboardInterrupt\n", "importing it raised KeyboardInterrupt"),
    ("\x00\x89PNG\n", "syntax error: source code string cannot contain null bytes"),  # not Python at all
    (MODEL_TAIL.replace("return nn.Linear(4, 2)", "import sys; sys.exit(3)"),
     "build_model() exited (sys.exit(3) or exit(3))"),
    (MODEL_TAIL.replace("return torch.randn", "raise KeyboardInterrupt; return torch.randn"),
     "make_batch(2) raised KeyboardInterrupt"),
])
def test_a_model_file_that_exits_is_one_line_naming_it(text, message, tmp_path):
    path = tmp_path / "model.py"
    path.write_text(text + ("" if "def build_model" in text else MODEL_TAIL))
    with pytest.raises(ModelFileError) as info:
        mf = load_model_file(str(path))
        mf.batch(2)
        mf.build()
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals: main thread")
def test_a_real_ctrl_c_while_importing_stays_an_interrupt(tmp_path):
    path = tmp_path / "model.py"
    path.write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n" + MODEL_TAIL)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (not SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt):
            load_model_file(str(path))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the watch is undone
    finally:
        signal.signal(signal.SIGINT, before)


def test_cli_trace_of_a_model_file_that_exits(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.py").write_text("import sys\nsys.exit(0)\n")
    assert _cli("trace", "model.py") == 2
    assert one_error_line(capsys) == "model.py: importing it exited (sys.exit(0) or exit(0)): a model file must not exit"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py"]


def test_a_folder_given_as_the_model_file(tmp_path, capsys):
    assert _cli("trace", tmp_path, "-o", tmp_path / "t.json") == 2
    assert one_error_line(capsys) == (f"{tmp_path}: is a folder without a config.json, expected a model file "
                                      "(path/to/model.py or package.module) or a transformers config (config.json or a "
                                      "folder holding one)")


# ---- runs (several processes) ----

@pytest.mark.multiprocess
def test_a_rank_that_exits_without_reporting_names_the_model_file(tmp_path):
    from shard_planner.execute import launch_plans

    plan = plan_failing_in_rank1(tmp_path, "exits_in_rank1.py", "os._exit(0)")
    model = plan.model.path
    with pytest.raises(RunError) as info:
        launch_plans([plan], steps=1, warmup=0, device="cpu", timeout_s=120)
    msg = str(info.value)
    assert msg.startswith("rank 1 exited with code 0 before finishing during 'build' "
                          f"(model file {model}; last output:"), msg
    for pid in info.value.pids:
        assert not _alive(pid)


@pytest.mark.multiprocess
def test_a_rank_that_aborts_after_finishing_keeps_the_results(tmp_path, caplog):
    """gloo's threads can abort a rank's interpreter exit after the run is done ("terminate called
    without an active exception"): the measurement stands, and the launcher says what happened."""
    from shard_planner.execute import launch_plans
    from shard_planner.trace.structure import model_fingerprint

    model = tmp_path / "aborts_at_exit_in_rank1.py"
    model.write_text(f"import atexit, os, sys\nsys.path.insert(0, {str(EXEC_NET.parent)!r})\nimport exec_net\n"
                     "make_batch, loss_fn = exec_net.make_batch, exec_net.loss_fn\n"
                     "def build_model():\n"
                     "    if os.environ.get('RANK') == '1':\n"
                     "        atexit.register(os.abort)\n"
                     "    return exec_net.build_model()\n")
    fingerprint = model_fingerprint(load_model_file(str(model)).build())
    plan = Plan.from_dict({**tiny_plan().to_dict(), "model": {"path": str(model), "fingerprint": fingerprint}})
    with caplog.at_level("WARNING", logger="shard_planner.execute.launch"):
        run = launch_plans([plan], steps=1, warmup=0, device="cpu", timeout_s=120)
    assert run.measurements[0].memory and run.measurements[0].step_time_s
    assert "rank 1 was killed by SIGABRT while exiting, after it had finished" in caplog.text


def _alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (a /proc scan; psutil is not a dependency)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
@pytest.mark.parametrize("sig, line, code", [(signal.SIGINT, "shard-planner: interrupted", 130),
                                             (signal.SIGTERM, "shard-planner: terminated (SIGTERM)", 143)])
def test_run_interrupted_stops_every_rank_and_writes_nothing(sig, line, code, tmp_path):
    save_plan(tiny_plan(), tmp_path / "plan.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shard_planner.cli.main", "run", str(tmp_path / "plan.json"), "--device", "cpu",
         "--steps", "100000", "--warmup", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
        # A shell may start background jobs with SIGINT ignored; a terminal's Ctrl-C finds it at default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        ranks, deadline = [], time.monotonic() + 180
        while len(ranks) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            ranks = _children(launcher.pid)
            time.sleep(0.2)
        assert len(ranks) == 2, launcher.communicate(timeout=60)
        time.sleep(3)  # the ranks are importing torch or training
        launcher.send_signal(sig)
        start = time.monotonic()
        while any(map(_alive, ranks)) and time.monotonic() - start < 10:
            time.sleep(0.05)
        assert not any(map(_alive, ranks)), "a rank outlived the launcher's interrupt by 10 s"
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == code and err.strip() == line, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no measurement, whole or partial


def test_run_with_a_missing_model_file_says_so_before_launching(tmp_path, capsys, monkeypatch):
    from shard_planner.execute import runner

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr(runner, "launch_local", no_launch)
    plan = Plan.from_dict({**tiny_plan().to_dict(), "model": {"path": "/nowhere/model.py", "fingerprint": "f"}})
    save_plan(plan, tmp_path / "plan.json")
    assert _cli("run", tmp_path / "plan.json", "--device", "cpu") == ModelFileError.exit_code
    assert one_error_line(capsys) == "/nowhere/model.py: the plan's model file: no such file here or beside the plan"
