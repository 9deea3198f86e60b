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
