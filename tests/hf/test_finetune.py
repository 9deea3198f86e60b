"""Fine-tuning a transformers config, planned and run with real FSDP2 on 2 gloo ranks (issue 28): the tiny
Llama of tests/hf/finetune.py with LoRA (``--lora 8``: peft's default targets, q_proj and v_proj, fp32
adapters on a bf16 base) and with QLoRA (``--lora 8 --qlora``, all-linear: NF4 base weights,
shard_planner/model/param_storage.py [Note: NF4 parameters as stored]). Each: the planner's own plan and one unit per
decoder layer (reshard after forward: the NF4 weights all-gathered again in backward), run in one world: the
measured peak within 3% of the predicted one and the collective bytes exactly as predicted. And the user's
path through the CLI: ``plan --lora 8`` records the fine-tune in the plan, ``run`` rebuilds it from there and
its checkpoint holds only the adapters and their optimizer state, restored bit for bit; ``estimate`` and
``report`` rebuild it from the plan too."""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from pathlib import Path

import pytest

from shard_planner.plan.finetune import ALL_LINEAR, FineTune
from tests.hf.finetune import LAYERS, load, need_finetune_extra, write_config

TOLERANCE = 0.03  # the peak within 3% of the prediction, as tests/hf/test_zoo.py asks of every architecture
ROOMY_BYTES = 4 * 2**30
KINDS = {"lora": FineTune(lora_rank=8), "qlora": FineTune(lora_rank=8, lora_targets=(ALL_LINEAR,), qlora=True)}


def _plans(path: str, finetune: FineTune):
    """The planner's plan and a unit per decoder layer, for the config fine-tuned as ``finetune`` says,
    each with its prediction and the fine-tune recorded (so the ranks build the same model)."""
    from shard_planner.cost import estimate
    from shard_planner.plan import Unit
    from shard_planner.hardware.profile import load_profile
    from shard_planner.solve import plan_model
    from shard_planner.solve.request import PlanRequest
    from shard_planner.trace import trace_model

    profile = load_profile("cpu-gloo")
    mf = load(path, finetune)
    trace = trace_model(mf)
    planned = plan_model(trace, PlanRequest(gpus=2, mem_budget_bytes=ROOMY_BYTES, profile=profile, model_path=path)).plan
    planned = replace(planned, model=replace(planned.model, finetune=mf.finetune), frontier=(), baselines=())
    layered = replace(planned, units=(Unit(("",), False), *(Unit((layer,), True) for layer in LAYERS)))
    layered = replace(layered, predicted=estimate(trace, layered, profile, timeline=False).prediction())
    return trace, [planned, layered]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fine_tune_runs_as_predicted_world_size_2(tmp_path, kind):
    need_finetune_extra(qlora=KINDS[kind].qlora)
    from shard_planner.execute import launch_plans

    path = write_config(tmp_path / kind)
    trace, plans = _plans(path, KINDS[kind])
    assert trace.has_frozen_params and trace.trainable_param_count < trace.param_count / 10
    measured = launch_plans(plans, steps=2, warmup=1, device="cpu", timeout_s=240).measurements
    for plan, m in zip(plans, measured):
        label = f"{kind}, units {[u.name for u in plan.units]}"
        assert m.comm_matches, (label, m.comm_measured, m.comm_predicted)
        assert m.peak_bytes == pytest.approx(plan.predicted.peak_bytes, rel=TOLERANCE), label


@pytest.mark.multiprocess
def test_cli_plans_lora_and_runs_it_from_the_plan(tmp_path):
    need_finetune_extra()
    from shard_planner.cli.main import main as cli_main
    from shard_planner.plan.measurement import load_measurement
    from shard_planner.plan import load_plan

    path = write_config(tmp_path / "cfg")
    plan_path = tmp_path / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["plan", path, "--lora", "8", "--gpus", "2", "--mem", "4GB", "--profile", "cpu-gloo",
                         "--seq-len", "32", "-o", str(plan_path), "--no-report"]) == 0
    plan = load_plan(plan_path)
    assert plan.model.finetune == FineTune(lora_rank=8, lora_targets=("q_proj", "v_proj"))  # peft's default for Llama
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["run", str(plan_path), "--steps", "1", "--warmup", "1", "--device", "cpu", "--timeout", "240"])
    text = out.getvalue()
    assert code == 0, text
    m = load_measurement(Path(plan_path).with_name("measurement.json"))
    assert m.comm_matches and m.peak_bytes == pytest.approx(plan.predicted.peak_bytes, rel=TOLERANCE)
    frozen = m.checkpoint.frozen_params_left_out
    assert frozen > 0 and f"the {frozen:,} frozen parameters are left out" in text
    restore = m.checkpoint.restores[0]
    assert restore.ok and not restore.tensors_differing
    # what was saved: the adapters (2 layers x q, v x A, B) and their AdamW states, not the base
    assert restore.tensors_checked < 100
    # estimate and report rebuild the same fine-tune from the plan (the fingerprint would refuse another model)
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["estimate", path, "--plan", str(plan_path)]) == 0
        assert cli_main(["report", str(plan_path), "-o", str(tmp_path / "report")]) == 0


def test_exports_carry_the_fine_tune_or_say_they_cannot(tmp_path):
    """The FSDP2 snippet builds the fine-tune (peft's call) and steps the trainable parameters; Accelerate and
    DeepSpeed say how to build it in the user's script; torchtitan 0.3 says plainly it cannot (issue 28 item 6)."""
    from shard_planner.report.export import export_plan
    from shard_planner.report.export.common import finetune_notes

    need_finetune_extra()
    plan = _plans(write_config(tmp_path), KINDS["lora"])[1][0]
    fsdp2 = export_plan(plan, "fsdp2").text
    assert "peft.get_peft_model" in fsdp2 and "if p.requires_grad" in fsdp2
    assert any("cannot express it" in n for n in finetune_notes(plan, "torchtitan 0.3", expressible=False))
    assert any("peft.LoraConfig(r=8" in n for n in finetune_notes(plan, "Accelerate", expressible=True))
    plain = replace(plan, model=replace(plan.model, finetune=None))
    assert "peft" not in export_plan(plain, "fsdp2").text and finetune_notes(plain, "Accelerate", True) == []
