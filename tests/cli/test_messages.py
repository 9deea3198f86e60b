"""What a new user reads when something is off (issue 36, items 8 and 12): one line that says what the
input was taken for and what is wrong with it, each warning once."""

import json

import pytest

from shard_planner.cli.main import main


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.startswith("shard-planner: error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err.removeprefix("shard-planner: error: ").rstrip("\n")


@pytest.mark.parametrize("name, text, says", [
    ("config.json", '{"model_type": "llama", ', "config.json: taken for a transformers config (by its name), but it "
     "is not JSON: Expecting property name enclosed in double quotes at line 1 column 25"),
    ("missing/config.json", None, "missing/config.json: taken for a transformers config (by its name), but there is "
     "no such file"),
    ("config.json", '{"hidden_size": 8}', "config.json: taken for a transformers config (by its name), but it has no "
     "model_type"),
    ("t.json", None, "t.json: taken for a trace.json from shard-planner trace (a .json that is not a transformers "
     "config, which has a model_type), but there is no such file"),
    ("t.json", "[1, 2", "t.json: taken for a trace.json from shard-planner trace (a .json that is not a transformers "
     "config, which has a model_type), but it is not JSON: Expecting ',' delimiter at line 1 column 6"),
])
def test_a_json_model_that_is_wrong_says_what_it_was_taken_for(name, text, says, tmp_path, capsys, monkeypatch):
    """It said `not a shard-planner trace file (JSONDecodeError...)` for a config.json with a syntax error and
    `cannot read trace file` for a config path that does not exist."""
    monkeypatch.chdir(tmp_path)
    if text is not None:
        (tmp_path / name).write_text(text)
    assert main(["plan", name, "--gpus", "2", "--mem", "1GB", "--profile", "cpu-gloo", "--no-report"]) == 2
    assert _one_error_line(capsys) == says
    assert not (tmp_path / "plan.json").exists()


# ---- each warning once per cause ----

def _warn_in_child_then_here(text: str) -> None:
    """The same warning from a forked process (as plan's helpers are) and then from this one."""
    import logging
    import os

    log = logging.getLogger("shard_planner.solve.planner")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        log.warning(text)
        os._exit(0)
    os.waitpid(pid, 0)
    log.warning(text)
    log.warning(text)


def test_a_warning_is_printed_once_across_the_commands_processes(capfd):
    """`plan` runs the planner once per tensor-parallel degree, here and in forked helpers, and `tune` at
    several budgets: a warning came 3-6 times. Same text, one line; another text is another cause."""
    from shard_planner.cli.main import configure_logging

    configure_logging(debug=False)
    _warn_in_child_then_here("no plan fits without CPU offload; offloading sharded state to the host")
    _warn_in_child_then_here("another cause")
    err = capfd.readouterr().err
    assert err.count("no plan fits without CPU offload") == 1, err
    assert err.count("another cause") == 1, err
    configure_logging(debug=False)  # the next command prints it again
    _warn_in_child_then_here("another cause")
    assert capfd.readouterr().err.count("another cause") == 1


def _plan_warnings(tmp_path, capsys, *args) -> str:
    from tests.paths import REPO

    assert main(["plan", str(REPO / "examples" / "llama.py"), "--gpus", "8", "--no-report", "--tp", "1",
                 "-o", str(tmp_path / "p.json"), *args]) == 0
    return capsys.readouterr().err


def test_mem_at_the_devices_nominal_size_means_the_device(tmp_path, capsys):
    """--mem 80GB on h100-80gb (79.65 GiB) warned `budget 80.00 GiB exceeds the memory of a h100-80gb device`
    (three times, once per degree); 100GB still does, once."""
    assert "exceeds the memory" not in _plan_warnings(tmp_path, capsys, "--mem", "80GB")
    assert _plan_warnings(tmp_path, capsys, "--mem", "100GB").count("exceeds the memory of a h100-80gb") == 1


@pytest.mark.parametrize("dtype, warned", [(["--dtype", "fp16"], True), ([], False), (["--dtype", "bf16"], False)])
def test_a_dtype_other_than_the_configs_is_said_once(dtype, warned, tmp_path, capsys):
    """`--dtype fp16` on a bf16 transformers config was taken without a word."""
    pytest.importorskip("transformers")
    from tests.hf.finetune import write_config

    config = write_config(tmp_path / "cfg")
    assert main(["plan", config, "--gpus", "2", "--mem", "4GB", "--profile", "cpu-gloo", "--seq-len", "32",
                 "--no-report", "-o", str(tmp_path / "p.json"), *dtype]) == 0
    err = capsys.readouterr().err
    assert err.count("the config's dtype is bfloat16, but the model is planned in float16 as --dtype asks") == warned, err


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    from tests.paths import REPO

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", str(REPO / "examples" / "llama.py"), "--gpus", "2", "--mem", "4GB", "--profile", "cpu-gloo",
                 "--no-report", "-o", str(path)]) == 0
    return path


@pytest.mark.parametrize("target, name, says", [
    ("torchtitan", "x.toml", "-o {out}: the torchtitan export is a Python config module (for torchtitan's "
     "--module/--config); name the file *.py"),
    ("accelerate", "x.json", "-o {out}: the accelerate export is a YAML config; name the file *.yaml"),
    ("deepspeed", "x.yaml", "-o {out}: the deepspeed export is a JSON config; name the file *.json"),
])
def test_an_export_is_written_only_to_a_file_of_its_format(target, name, says, tiny_plan, tmp_path, capsys):
    """`export --to torchtitan -o x.toml` wrote a Python config function into a .toml file."""
    out = tmp_path / name
    assert main(["export", str(tiny_plan), "--to", target, "-o", str(out)]) == 2
    assert _one_error_line(capsys) == says.format(out=out)
    assert not out.exists()
    assert main(["export", str(tiny_plan), "--to", "accelerate", "-o", str(tmp_path / "x.yml")]) == 0


def test_export_trace_takes_a_model_file_as_report_trace_does(tiny_plan, tmp_path, capsys):
    """`export --trace` took only a trace.json where `report --trace` takes a model file too."""
    from tests.paths import REPO

    via_model = tmp_path / "m.json"
    assert main(["export", str(tiny_plan), "--to", "deepspeed", "-o", str(via_model), "--trace",
                 str(REPO / "examples" / "llama.py")]) == 0
    assert main(["trace", str(REPO / "examples" / "llama.py"), "-o", str(tmp_path / "t.json")]) == 0
    via_trace = tmp_path / "t_export.json"
    assert main(["export", str(tiny_plan), "--to", "deepspeed", "-o", str(via_trace), "--trace",
                 str(tmp_path / "t.json")]) == 0
    assert json.loads(via_model.read_text()) == json.loads(via_trace.read_text())


def test_the_global_batch_asked_for_is_recorded_without_accumulation_too(tmp_path, capsys):
    """With accumulation 1 the summary had no global-batch line and plan.json did not record --global-batch."""
    from shard_planner.plan import load_plan
    from tests.paths import REPO

    out = tmp_path / "p.json"
    assert main(["plan", str(REPO / "examples" / "llama.py"), "--gpus", "8", "--mem", "40GB", "--global-batch", "512",
                 "--no-report", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    plan = load_plan(out)
    assert plan.training.accumulation_steps == 1 and plan.training.global_batch_asked == 512
    assert json.loads(out.read_text())["training"]["global_batch_asked"] == 512
    assert f"global batch 512 (as asked) = micro-batch {plan.training.micro_batch} x " in text
    assert plan.with_world_size(4).training.global_batch_asked is None  # another size reaches another batch
    assert main(["plan", str(REPO / "examples" / "llama.py"), "--gpus", "8", "--mem", "40GB", "--no-report",
                 "-o", str(out)]) == 0
    assert "global_batch_asked" not in json.loads(out.read_text())["training"]  # none asked: as before


def test_a_cpu_plan_speaks_of_cpu_ranks(tmp_path, capsys):
    """CPU plans said "GPUs": FSDP over 2 GPUs, per GPU, on 2 GPUs."""
    from tests.paths import REPO

    out = tmp_path / "p.json"
    model = str(REPO / "examples" / "llama.py")
    assert main(["plan", model, "--gpus", "2", "--mem", "4GB", "--profile", "cpu-gloo", "--global-batch", "16",
                 "--no-report", "-o", str(out)]) == 0
    assert main(["estimate", model, "--plan", str(out)]) == 0
    text = capsys.readouterr().out
    assert "GPU" not in text, text
    assert "FSDP over 2 CPU ranks" in text and "per CPU rank" in text and "on 2 CPU ranks" in text
    assert "micro-batch 8 x 2 CPU ranks" in text
    assert main(["plan", model, "--gpus", "1", "--mem", "1GB", "--profile", "cpu-gloo", "--no-report",
                 "-o", str(out)]) == 0
    assert "tokens/s on 1 CPU rank," in capsys.readouterr().out  # it said "on 1 CPU ranks"


def test_runs_losses_say_which_steps_they_are():
    """On CPU `run` printed 8 losses for 7 steps (2 warm-up + 5 timed): the 8th is the step measured under the
    storage tracker."""
    from dataclasses import replace

    from shard_planner.cli.run import losses_line
    from tests.tune.test_tune import fake_run_plans, make_plan

    m = fake_run_plans([])([make_plan()], world_size=2, steps=5, warmup=2, timeout_s=1, device="cpu")[0]
    m = replace(m, losses=(1.0,) * 8, step_time_s=(0.1,) * 5)
    assert losses_line(m).startswith("losses (2 warm-up, 5 timed, 1 more measuring peak memory [storage-tracker]): ")
    assert losses_line(m).count("1.0000") == 8
    gpu = replace(m, losses=(1.0,) * 7)
    assert losses_line(gpu).startswith("losses (2 warm-up, 5 timed): ")


def test_the_checkpoint_note_says_where_frozen_parameters_come_from(tmp_path):
    """The LoRA checkpoint note said "the model file builds them" for a transformers config."""
    from dataclasses import replace

    from shard_planner.cli.run import frozen_source
    from tests.hf.finetune import write_config
    from tests.tune.test_tune import make_plan

    plan = make_plan()
    config = replace(plan, model=replace(plan.model, path=write_config(tmp_path / "cfg")))
    assert "pretrained weights" in frozen_source(config) and "model file" not in frozen_source(config)
    assert frozen_source(plan) == "the model file builds them"
