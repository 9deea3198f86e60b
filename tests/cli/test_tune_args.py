"""tune's command line reaches the plan search as plan's does (issue 36, item 11): the global batch, the
search flags and a transformers config's fine-tune; and its warnings name the ranks it runs (item 8)."""

import logging

import pytest

from tests.hf.finetune import need_finetune_extra, write_config
from tests.paths import REPO
from tests.tune.test_tune import fake_run_plans


def _tune(monkeypatch, argv: list[str]):
    """Run `tune` with a fake launcher; the candidates it was given and the keyword arguments of tune_model."""
    import shard_planner.tune as tune_pkg
    from shard_planner.cli.main import main

    seen = {}
    real = tune_pkg.tune_model

    def tune_model(model, **kw):
        seen.update(kw)
        return real(model, **{**kw, "run_plans": _recording(seen)})

    monkeypatch.setattr(tune_pkg, "tune_model", tune_model)
    assert main(["tune", *argv, "--no-report", "--device", "cpu", "--trials", "1"]) == 0
    return seen


def _recording(seen: dict):
    inner = fake_run_plans([])

    def run_plans(plans, **kw):
        seen.setdefault("ran", []).extend(plans)
        return inner(plans, **kw)

    return run_plans


def test_tune_plans_to_a_global_batch(tmp_path, monkeypatch):
    """tune had no --global-batch: now the candidates reach it as plan's do (micro-batch x steps x ranks)."""
    seen = _tune(monkeypatch, [str(REPO / "examples" / "gpt2.py"), "--gpus", "2", "--mem", "1GB", "--world-size",
                               "2", "--global-batch", "16", "--time-limit", "0.5", "-o", str(tmp_path / "p.json")])
    assert seen["plan_options"] == {"time_limit_s": 0.5, "search_batch": False, "global_batch_samples": 16}
    for plan in seen["ran"]:
        t = plan.training
        assert t.micro_batch * t.accumulation_steps * plan.mesh.dp_size == 16


def test_tune_fine_tunes_a_transformers_config(tmp_path, monkeypatch):
    """tune lacked --lora/--qlora/--freeze: every plan it runs records the fine-tune (run rebuilds it)."""
    need_finetune_extra()
    config = write_config(tmp_path / "cfg")
    seen = _tune(monkeypatch, [config, "--gpus", "2", "--mem", "4GB", "--world-size", "2", "--lora", "8",
                               "--seq-len", "32", "-o", str(tmp_path / "p.json")])
    assert seen["hf_options"].finetune.lora_rank == 8
    assert seen["ran"] and all(p.model.finetune is not None and p.model.finetune.lora_rank == 8 for p in seen["ran"])


@pytest.mark.parametrize("world_size, says", [(2, None), (4, "4 ranks share this host's 2 cores")])
def test_tunes_core_sharing_warning_names_the_ranks_it_runs(world_size, says, tmp_path, caplog):
    """tune for 8 GPUs on cpu-gloo, running 2 ranks, warned `8 ranks share this host's 2 cores` 6 times."""
    from shard_planner.tune import tune_model

    with caplog.at_level(logging.WARNING, logger="shard_planner"):
        tune_model(str(REPO / "examples" / "gpt2.py"), gpus=8, mem_budget_bytes=2**30, profile="cpu-gloo", trials=1,
                   world_size=world_size, run_plans=fake_run_plans([]), device="cpu")
    shared = [r.getMessage() for r in caplog.records if "share this host's" in r.getMessage()]
    assert not any(m.startswith("8 ranks") for m in shared), shared
    assert (says is None and not shared) or (shared and all(m.startswith(says) for m in shared)), shared
