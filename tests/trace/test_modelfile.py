"""Every way a model file can break the contract gives one ModelFileError line naming the file, from
the API and from the CLI (exit code 2, one line on stderr; --debug shows the traceback)."""

from __future__ import annotations

import logging
import textwrap

import pytest

from shard_planner.cli.main import main
from shard_planner.errors import ModelFileError
from shard_planner.model.modelfile import load_model_file
from shard_planner.trace import trace_model

GOOD_MODEL = """
import torch
import torch.nn as nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
"""
GOOD_BATCH = """
def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))
"""

# name -> (file text, a fragment the one-line message must contain)
BROKEN = {
    "syntax_error": ("def build_model(:\n    pass\n", "syntax error"),
    "no_build_model": ("import torch\n" + GOOD_BATCH, "defines no build_model()"),
    "no_make_batch": (GOOD_MODEL, "defines no make_batch()"),
    "build_model_raises": (
        "import torch\ndef build_model():\n    raise ValueError('no config for size huge')\n" + GOOD_BATCH,
        "build_model() raised ValueError: no config for size huge",
    ),
    "build_model_returns_int": ("import torch\ndef build_model():\n    return 3\n" + GOOD_BATCH, "expected a torch.nn.Module"),
    "make_batch_not_a_pair": (
        GOOD_MODEL + "\ndef make_batch(batch_size):\n    return torch.randn(batch_size, 8)\n",
        "expected a pair (inputs, targets)",
    ),
    "make_batch_inputs_not_tensors": (
        GOOD_MODEL + "\ndef make_batch(batch_size):\n    return [1, 2], torch.zeros(batch_size)\n",
        "inputs must be a tensor or a tuple of tensors",
    ),
    "loss_not_scalar": (
        GOOD_MODEL + GOOD_BATCH + "\ndef loss_fn(output, targets):\n    return output\n",
        "loss_fn must return a scalar tensor",
    ),
    "training_not_a_dict": (GOOD_MODEL + GOOD_BATCH + "\nTRAINING = [1]\n", "TRAINING must be a dict"),
    "training_bad_value": (GOOD_MODEL + GOOD_BATCH + "\nTRAINING = {'micro_batch': -1}\n", "TRAINING['micro_batch']"),
    "training_unknown_key": (GOOD_MODEL + GOOD_BATCH + "\nTRAINING = {'epochs': 3}\n", "unknown key 'epochs'"),
    "import_raises": ("import torch\nraise RuntimeError('needs a GPU')\n", "importing it raised RuntimeError: needs a GPU"),
    "shape_error_in_fake_mode": (
        GOOD_MODEL.replace("nn.Linear(16, 4)", "nn.Linear(15, 4)") + GOOD_BATCH,
        "in module '2'",
    ),
}


def write(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(BROKEN[name][0]))
    return str(path)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_contract_violation_is_one_line_naming_the_file(name, tmp_path, caplog, monkeypatch):
    path = write(tmp_path, name)
    caplog.set_level(logging.ERROR, logger="torch._subclasses.fake_tensor")
    monkeypatch.setattr(logging.getLogger("torch._subclasses.fake_tensor"), "propagate", True)
    with pytest.raises(ModelFileError) as info:
        trace_model(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(path)
    assert BROKEN[name][1] in message
    # FakeTensorMode's own traceback logging is quieted: the error is reported once, by us.
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses.fake_tensor") and r.levelno >= logging.ERROR]


@pytest.mark.parametrize("name", ["syntax_error", "no_make_batch", "build_model_raises", "shape_error_in_fake_mode"])
def test_cli_prints_one_line_and_exits_non_zero(name, tmp_path, capsys):
    path = write(tmp_path, name)
    rc = main(["trace", path, "-o", str(tmp_path / "t.json")])
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("shard-planner: error: ") and path in lines[0]
    assert BROKEN[name][1] in lines[0]
    assert captured.out == ""
    assert not (tmp_path / "t.json").exists()


def test_cli_debug_shows_the_traceback(tmp_path):
    path = write(tmp_path, "shape_error_in_fake_mode")
    with pytest.raises(ModelFileError) as info:
        main(["--debug", "trace", path, "-o", str(tmp_path / "t.json")])
    assert info.value.__cause__ is not None  # the user's exception is chained, so the traceback shows it


def test_missing_file_and_module(tmp_path):
    with pytest.raises(ModelFileError, match="no such model file"):
        load_model_file(str(tmp_path / "nope.py"))
    with pytest.raises(ModelFileError, match="no such file or importable module"):
        load_model_file("no_such_package.no_module")


def test_a_good_file_traces(tmp_path):
    path = tmp_path / "good.py"
    path.write_text(GOOD_MODEL + GOOD_BATCH)
    trace = trace_model(str(path), dtype="fp32")
    assert trace.param_count == 8 * 16 + 16 + 16 * 4 + 4
    assert trace.tokens_per_sample is None
    assert trace.forward_order == ("", "0", "1", "2")
    assert trace.backward_order == ("", "2", "1", "0")


def test_training_defaults(tmp_path):
    from shard_planner.model.modelfile import TrainingDefaults, training_defaults

    path = tmp_path / "good.py"
    path.write_text(GOOD_MODEL + GOOD_BATCH + "\nTRAINING = {'micro_batch': 3, 'optimizer': 'sgd', 'lr': 0.1}\n")
    assert training_defaults(load_model_file(str(path))) == TrainingDefaults(micro_batch=3, optimizer="sgd", lr=0.1)
    path.write_text(GOOD_MODEL + GOOD_BATCH + "\nTRAINING = {'micro_batch': 5}\n")
    assert load_model_file(str(path)).defaults == TrainingDefaults(micro_batch=5, optimizer="adamw", lr=1e-3)
    assert training_defaults(None) == TrainingDefaults(micro_batch=1, optimizer="adamw")  # a trace.json


def test_plan_and_tune_load_the_model_file_once(tmp_path, monkeypatch):
    """plan reads the TRAINING defaults (learning rate included) from the file it traced, and from a trace.json
    of it; tune traces in the dtype asked."""
    import shard_planner.model.modelfile as modelfile
    import shard_planner.solve as solve
    from shard_planner.tune import tune_model

    path = tmp_path / "good.py"
    path.write_text(GOOD_MODEL + GOOD_BATCH + "\nTRAINING = {'micro_batch': 3, 'optimizer': 'sgd', 'lr': 3e-4}\n")
    imports = []
    real_import = modelfile._import
    monkeypatch.setattr(modelfile, "_import", lambda p: imports.append(p) or real_import(p))
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--gpus", "2", "--mem", "1GB", "--profile", "cpu-gloo", "--dtype", "fp32",
                 "-o", str(out), "--no-report", "--time-limit", "1"]) == 0
    from shard_planner.plan import load_plan

    plan = load_plan(out)
    assert (plan.training.micro_batch, plan.training.optimizer, plan.training.param_dtype) == (3, "sgd", "float32")
    assert plan.training.lr == 3e-4
    assert len(imports) == 1
    traced = tmp_path / "trace.json"
    assert main(["trace", str(path), "--dtype", "fp32", "-o", str(traced)]) == 0
    assert main(["plan", str(traced), "--gpus", "2", "--mem", "1GB", "--profile", "cpu-gloo", "--dtype", "fp32",
                 "-o", str(out), "--no-report", "--time-limit", "1"]) == 0
    assert load_plan(out).training.lr == 3e-4

    class Stop(Exception):
        pass

    seen = {}

    def fake_plan_model(trace, request):
        seen.update(trace_dtype=trace.compute_dtype, **vars(request))
        raise Stop

    imports.clear()
    monkeypatch.setattr(solve, "plan_model", fake_plan_model)
    with pytest.raises(Stop):
        tune_model(str(path), gpus=2, mem_budget_bytes=2**30, profile="cpu-gloo", dtype="float32")
    assert seen["trace_dtype"] == seen["param_dtype"] == "float32"
    assert (seen["micro_batch"], seen["optimizer"], seen["lr"]) == (3, "sgd", 3e-4)
    assert len(imports) == 1
