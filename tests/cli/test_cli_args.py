"""CLI argument handling shared by the commands: dtype choices, positive numbers, one-line errors."""

import argparse

import pytest

from shard_planner.cli.main import build_parser
from shard_planner.units import DTYPE_NAMES


@pytest.mark.parametrize("command", [["trace", "m.py"], ["plan", "m.py", "--gpus", "8", "--mem", "40GB"]])
@pytest.mark.parametrize("dtype", sorted(DTYPE_NAMES))
def test_every_dtype_name_is_accepted_by_trace_and_plan(command, dtype):
    args = build_parser().parse_args([*command, "--dtype", dtype])
    assert args.dtype == dtype


# (command line without the flag, flag, a bad value, what the one line says)
BAD_VALUES = [
    (["plan", "m.py", "--mem", "40GB"], "--gpus", "0", "--gpus must be a positive integer, got '0'"),
    (["plan", "m.py", "--gpus", "8"], "--mem", "forty", "--mem must be a positive memory size such as 40GB"),
    (["plan", "m.py", "--gpus", "8"], "--mem", "0GB", "--mem must be a positive memory size"),
    (["plan", "m.py", "--gpus", "8", "--mem", "40GB"], "--gpus-per-node", "-1", "--gpus-per-node must be a positive"),
    (["plan", "m.py", "--gpus", "8", "--mem", "40GB"], "--batch-size", "two", "--batch-size must be a positive integer, got 'two'"),
    (["plan", "m.py", "--gpus", "8", "--mem", "40GB"], "--time-limit", "0", "--time-limit must be a positive number, got '0'"),
    (["plan", "m.py", "--gpus", "8", "--mem", "40GB"], "--time-limit", "nan", "--time-limit must be a positive number"),
    (["estimate", "m.py", "--plan", "p.json"], "--gpus", "0", "--gpus must be a positive integer"),
    (["estimate", "m.py", "--plan", "p.json"], "--micro-batch", "0", "--micro-batch must be a positive integer"),
    (["trace", "m.py"], "--batch-size", "0", "--batch-size must be a positive integer"),
    (["trace", "m.py"], "--check", "-2", "--check must be a positive integer"),
    (["run", "p.json"], "--steps", "0", "--steps must be a positive integer"),
    (["run", "p.json"], "--warmup", "-1", "--warmup must be a non-negative integer, got '-1'"),
    (["run", "p.json"], "--world-size", "0", "--world-size must be a positive integer"),
    (["run", "p.json"], "--timeout", "-5", "--timeout must be a positive number"),
    (["tune", "m.py", "--mem", "1GB"], "--gpus", "0", "--gpus must be a positive integer"),
    (["tune", "m.py", "--gpus", "2"], "--mem", "lots", "--mem must be a positive memory size"),
    (["tune", "m.py", "--gpus", "2", "--mem", "1GB"], "--trials", "0", "--trials must be a positive integer"),
    (["tune", "m.py", "--gpus", "2", "--mem", "1GB"], "--world-size", "0", "--world-size must be a positive integer"),
    (["tune", "m.py", "--gpus", "2", "--mem", "1GB"], "--gpus-per-node", "0", "--gpus-per-node must be a positive"),
    (["tune", "m.py", "--gpus", "2", "--mem", "1GB"], "--micro-batch", "0", "--micro-batch must be a positive integer"),
    (["tune", "m.py", "--gpus", "2", "--mem", "1GB"], "--steps", "0", "--steps must be a positive integer"),
    (["tune", "m.py", "--gpus", "2", "--mem", "1GB"], "--warmup", "-1", "--warmup must be a non-negative integer"),
    (["tune", "m.py", "--gpus", "2", "--mem", "1GB"], "--per-launch", "0", "--per-launch must be a positive integer"),
    (["tune", "m.py", "--gpus", "2", "--mem", "1GB"], "--timeout", "0", "--timeout must be a positive number"),
]


@pytest.mark.parametrize("argv, flag, value, message", BAD_VALUES)
def test_a_bad_value_is_one_line_before_anything_runs(argv, flag, value, message, capsys):
    from shard_planner.cli.main import main

    assert main([*argv, flag, value]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("shard-planner: error: ") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err and captured.out == ""


@pytest.mark.parametrize("argv, flag, value, message", BAD_VALUES)
def test_good_values_parse_to_numbers(argv, flag, value, message):
    good = {"--mem": ("80GiB", 80 * 2**30), "--warmup": ("0", 0), "--time-limit": ("0.5", 0.5),
            "--timeout": ("2.5", 2.5)}.get(flag, ("3", 3))
    args = build_parser().parse_args([*argv, flag, good[0]])
    dest = {"--batch-size": "micro_batch"}.get(flag, flag.lstrip("-").replace("-", "_"))  # an alias of --micro-batch
    assert getattr(args, dest) == good[1]


@pytest.mark.parametrize("argv, message", [
    (["plan", "m.py", "--gpus", "8"], "the following arguments are required: --mem; see shard-planner plan --help"),
    (["plan", "m.py", "--mem", "40GB"], "the following arguments are required: --gpus; see shard-planner plan --help"),
    (["plan", "m.py", "--gpus", "8", "--mem", "-1GB"],
     "--mem needs a value (one that starts with '-' is read as an option: write --mem=VALUE); see shard-planner plan"),
    (["plan", "m.py", "--gpus", "8", "--mem=-1GB"], "--mem must be a positive memory size"),
    (["plan", "m.py", "--gpus", "8", "--mem", "40GB", "--dtype", "int8"], "argument --dtype: invalid choice"),
    (["plan", "m.py", "--gpus", "8", "--mem", "40GB", "--gpu", "8"], "ambiguous option: --gpu could match --gpus"),
    (["plan", "m.py", "--gpus", "8", "--mem", "40GB", "--nodes", "2"], "unrecognized arguments: --nodes 2"),
    (["plann", "m.py"], "invalid choice: 'plann'"),
    ([], "the following arguments are required: COMMAND; see shard-planner --help"),
])
def test_other_argparse_errors_are_one_line_too(argv, message, capsys):
    """Not argparse's usage (a dozen lines for plan) before the line that says what is wrong."""
    from shard_planner.cli.main import main

    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("shard-planner: error: ") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err and captured.out == ""
    assert "usage:" not in captured.err


def test_the_worker_entry_point_checks_its_counts_too(capsys):
    """``python -m shard_planner.execute.worker`` (torchrun) rejects what ``run`` rejects, before joining a world."""
    from shard_planner.execute.worker import main as worker_main

    with pytest.raises(SystemExit) as info:
        worker_main(["plan.json", "--steps", "0"])
    assert info.value.code == 2 and "--steps: must be a positive integer, got '0'" in capsys.readouterr().err


def test_a_memory_size_without_a_unit_is_refused_before_tracing(capsys):
    """`--mem 40` was read as 40 bytes and failed after seconds of tracing (`no plan fits 40 B`)."""
    from shard_planner.cli.main import main

    for command in (["plan", "m.py", "--gpus", "8"], ["tune", "m.py", "--gpus", "2"]):
        assert main([*command, "--mem", "40"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--mem must be a memory size with its unit such as 40GB" in err, err
    assert build_parser().parse_args(["plan", "m.py", "--gpus", "8", "--mem", "40 GB"]).mem == 40 * 2**30


@pytest.mark.parametrize("argv, debug", [
    (["run", "p.json", "--debug"], True), (["--debug", "run", "p.json"], True), (["run", "p.json"], False),
    (["plan", "m.py", "--gpus", "8", "--mem", "40GB", "--debug"], True), (["export", "p.json", "--to", "fsdp2"], False),
])
def test_debug_before_or_after_the_command(argv, debug):
    assert build_parser().parse_args(argv).debug is debug


def test_version(capsys):
    from shard_planner import __version__
    from shard_planner.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and f"shard-planner {__version__}" in capsys.readouterr().out


def _options(command: str) -> dict:
    """``{option string: argparse action}`` of a command's parser."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s: a for a in sub.choices[command]._actions for s in a.option_strings}


MICRO_BATCH_COMMANDS = [["plan", "m.py", "--gpus", "8", "--mem", "40GB"], ["trace", "m.py"],
                        ["tune", "m.py", "--gpus", "2", "--mem", "1GB"], ["estimate", "m.py", "--plan", "p.json"],
                        ["calibrate", "--model", "m.py"]]


@pytest.mark.parametrize("argv", MICRO_BATCH_COMMANDS)
@pytest.mark.parametrize("flag", ["--micro-batch", "--batch-size"])
def test_one_name_for_the_micro_batch_everywhere(argv, flag):
    """plan and trace said --batch-size, tune, estimate and calibrate --micro-batch: --micro-batch everywhere,
    --batch-size its alias."""
    assert build_parser().parse_args([*argv, flag, "3"]).micro_batch == 3


# Flags that mean the same in every command that takes them: defined once (cli/args.py), so their help and
# type are the same objects' words. (A command may say what its default is: --profile, --micro-batch, --gpus.)
SHARED = ["--gpus-per-node", "--dtype", "--device", "--time-limit", "--search-batch", "--global-batch",
          "--global-batch-tokens", "--lora", "--lora-targets", "--qlora", "--freeze", "--hf-task", "--seq-len",
          "--report-dir", "--no-report", "--tp", "--no-sequence-parallel", "--no-loss-parallel", "--mem",
          "--timings", "--debug"]
COMMANDS = ["trace", "estimate", "calibrate", "plan", "run", "tune"]


@pytest.mark.parametrize("flag", SHARED)
def test_a_flag_means_the_same_in_every_command(flag):
    actions = {c: _options(c)[flag] for c in COMMANDS if flag in _options(c)}
    assert len(actions) >= 2 or flag == "--debug", actions
    first = next(iter(actions.values()))
    for command, action in actions.items():
        assert (action.type, action.choices, action.option_strings, action.metavar) == (
            first.type, first.choices, first.option_strings, first.metavar), command
        if flag not in ("--tp", "--timings"):  # their help says the command's default
            assert action.help == first.help, command
        assert action.help, f"{command} {flag} has no help"


def test_tune_takes_what_plan_takes_for_its_search():
    """tune lacked --global-batch, the fine-tune flags, --search-batch and --time-limit; its --gpus-per-node said
    "(default 8)" where plan's is the profile's; its MODEL said "model file" where it takes a config too."""
    plan, tune = _options("plan"), _options("tune")
    for flag in ("--global-batch", "--global-batch-tokens", "--lora", "--lora-targets", "--qlora", "--freeze",
                 "--search-batch", "--time-limit", "--report", "--report-dir", "--no-report", "--micro-batch"):
        assert flag in plan and flag in tune, flag
    assert tune["--gpus-per-node"].default is None and "the profile's" in tune["--gpus-per-node"].help
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    model = next(a for a in sub.choices["tune"]._actions if a.dest == "model")
    assert "transformers config" in model.help
    args = parser.parse_args(["tune", "cfg.json", "--gpus", "8", "--mem", "8GB", "--lora", "8", "--global-batch",
                              "64", "--report", "r"])
    assert (args.lora, args.global_batch, args.report_dir, args.report) == (8, 64, "r", True)


def test_calibrate_quick_promises_what_it_does():
    """`calibrate --quick` promised about half the time and took 7.9 s against 8.5 s: the ranks' launch and the
    framework overheads (most of the command) are the same either way; the help now says so."""
    text = _options("calibrate")["--quick"].help
    assert "half the time" not in text and "kernel sweep" in text and "collectives" in text


def test_the_parser_imports_no_report():
    """Building every command's parser (a bare ``shard-planner --help``) imports neither matplotlib nor pandas:
    the export command names its targets itself (cli/export.py KINDS), the same as report/export's TARGETS."""
    import subprocess
    import sys

    from shard_planner.cli.export import KINDS
    from shard_planner.report.export import TARGETS

    assert tuple(KINDS) == TARGETS
    code = ("import sys; from shard_planner.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('matplotlib', 'pandas', 'shard_planner.report') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
