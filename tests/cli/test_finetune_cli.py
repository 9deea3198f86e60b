"""The fine-tuning options (--lora, --lora-targets, --qlora, --freeze; shard_planner/plan/finetune.py): bad input is
one line and a non-zero exit, never a traceback; the plan's model.finetune round-trips, and plans without it
read and write as before."""

from __future__ import annotations

import builtins
import json

import pytest

from shard_planner.cli.main import main
from shard_planner.errors import PlanError
from shard_planner.plan.finetune import FineTune
from shard_planner.plan import Plan, load_plan, save_plan
from tests.hf.finetune import need_finetune_extra, write_config
from tests.paths import MODELS


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("shard-planner: error: "), err
    return err.removeprefix("shard-planner: error: ")


@pytest.fixture
def config(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'shard-planner[hf]')")
    return write_config(tmp_path / "cfg")


@pytest.mark.parametrize("options, says", [
    (["--qlora"], "--qlora puts LoRA adapters on an NF4 base: give --lora R too"),
    (["--lora-targets", "q_proj"], "give --lora R"),
    (["--lora", "8", "--freeze", "lm_head"], "peft already freezes every base parameter"),
    (["--lora", "0"], "--lora must be a positive integer"),
    (["--lora", "8", "--lora-targets", "all-linear,q_proj"], "all-linear stands alone"),
])
def test_contradictory_options_are_one_line(config, tmp_path, capsys, options, says):
    code = main(["trace", config, *options, "-o", str(tmp_path / "t.json")])
    assert code == 2 and says in one_error_line(capsys)


def test_freeze_pattern_matching_nothing_is_one_line(config, tmp_path, capsys):
    assert main(["trace", config, "--freeze", "vision_tower*", "-o", str(tmp_path / "t.json")]) == 2
    assert "--freeze 'vision_tower*' matches no module (names look like model, model.embed_tokens" in one_error_line(capsys)


def test_lora_targets_peft_cannot_find_are_one_line(config, tmp_path, capsys):
    need_finetune_extra()
    assert main(["trace", config, "--lora", "8", "--lora-targets", "c_attn", "-o", str(tmp_path / "t.json")]) == 2
    assert "peft cannot put LoRA on c_attn: Target modules {'c_attn'} not found" in one_error_line(capsys)


def test_qlora_on_weights_nf4_cannot_split_is_one_line(tmp_path, capsys):
    need_finetune_extra(qlora=True)
    config = write_config(tmp_path / "odd", hidden_size=96, intermediate_size=192, num_attention_heads=3,
                          num_key_value_heads=3)
    assert main(["trace", config, "--lora", "8", "--qlora", "-o", str(tmp_path / "t.json")]) == 2
    assert "model.layers.0.self_attn.q_proj.weight (96, 96) has 9216 elements, not a multiple of 16384" in one_error_line(capsys)


def test_lora_without_peft_says_how_to_install_it(config, tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    assert main(["trace", config, "--lora", "8", "-o", str(tmp_path / "t.json")]) == 2
    assert one_error_line(capsys).endswith("--lora needs peft: pip install 'shard-planner[finetune]'")


def test_finetune_options_on_a_model_file_are_one_line(tmp_path, capsys):
    assert main(["trace", str(MODELS / "exec_net.py"), "--lora", "8", "-o", str(tmp_path / "t.json")]) == 2
    assert "apply to a transformers config (config.json) only" in one_error_line(capsys)


def _plan_dict() -> dict:
    from tests.execute.test_run import make_plan
    from shard_planner.plan import Unit

    return make_plan([Unit(("",), False)], 2, model=str(MODELS / "exec_net.py")).to_dict()


def test_plan_without_finetune_reads_and_writes_as_before(tmp_path):
    d = _plan_dict()
    assert "finetune" not in d["model"]  # a plan without a fine-tune is written as before it
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    assert load_plan(path).model.finetune is None


def test_plan_finetune_round_trips_and_is_checked(tmp_path):
    d = _plan_dict()
    d["model"]["finetune"] = {"lora_rank": 16, "lora_targets": ["all-linear"], "qlora": True, "freeze": []}
    plan = Plan.from_dict(d)
    assert plan.model.finetune == FineTune(16, ("all-linear",), True)
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan
    d["model"]["finetune"]["lora_rank"] = 0
    with pytest.raises(PlanError, match=r"model\.finetune\.lora_rank must be a positive integer"):
        Plan.from_dict(d)
    d["model"]["finetune"].update(lora_rank=None, lora_targets=[])
    with pytest.raises(PlanError, match="--qlora puts LoRA adapters on an NF4 base"):
        Plan.from_dict(d)
