"""Exports of plans with selective activation checkpointing: torchtitan 0.3's per-op ``SelectiveAC``
(full checkpointing where its one-mode-for-all-blocks cannot say the plan), notes where Accelerate and
DeepSpeed cannot say it, and FSDP2 code that checkpoints selectively as apply_plan does."""

from dataclasses import replace

import pytest
import torch

from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Unit
from shard_planner.report.export import export_plan, model_info_from_trace
from shard_planner.trace.kernel_ops import op_class
from tests.models.report_fixtures import make_plan, make_trace
from tests.report.test_export import GPT2, gpt2_plan, torchtitan_settings

pytestmark = pytest.mark.usefixtures("in_repository_root")
SEL = "selective"


def _with_blocks(modes, save_ops=()):
    base = make_plan(len(modes), checkpoint_every=0)
    units = [replace(u, activation_checkpoint=modes[int(u.modules[0].split(".")[1])],
                     ac_save_ops=save_ops if modes[int(u.modules[0].split(".")[1])] == SEL else ())
             if u.modules[0].startswith("blocks.") else u for u in base.units]
    return replace(base, units=tuple(units))


def test_torchtitan_op_level_selective():
    export = export_plan(_with_blocks([SEL] * 4), "torchtitan")
    assert torchtitan_settings(export.text)["ACTIVATION_CHECKPOINT"] == "selective"
    assert any("every second mm" in n for n in export.notes)


def test_torchtitan_patterns_it_cannot_say_fall_back_to_full():
    """Every k-th block, selective mixed with full, or a selective save set that keeps less than
    torchtitan's SelectiveAC: full checkpointing of every block (no more memory than the plan);
    selective mixed with unchekpointed blocks: SelectiveAC on all (also no more memory)."""
    ac = lambda plan: torchtitan_settings(export_plan(plan, "torchtitan").text)["ACTIVATION_CHECKPOINT"]
    assert ac(_with_blocks([False, False, True] * 2)) == "full"
    mixed = export_plan(_with_blocks([SEL, True, SEL, False]), "torchtitan")
    assert torchtitan_settings(mixed.text)["ACTIVATION_CHECKPOINT"] == "full"
    assert any("2 fully" not in n and "1 fully, 2 selectively" in n for n in mixed.notes)
    partial = export_plan(_with_blocks([SEL, False, SEL, False]), "torchtitan")
    assert torchtitan_settings(partial.text)["ACTIVATION_CHECKPOINT"] == "selective"
    assert any("2 of 4 blocks selectively" in n for n in partial.notes)
    assert ac(_with_blocks([SEL] * 2, ("matmul", "elementwise"))) == "full"  # no attention kept: torchtitan keeps more


def test_accelerate_and_deepspeed_say_they_cannot_express_selective():
    plan = _with_blocks([SEL] * 4)
    info = model_info_from_trace(make_trace(4))
    acc = export_plan(plan, "accelerate", info)
    assert any("no per-op policy" in n for n in acc.notes)
    ds = export_plan(plan, "deepspeed", info)
    assert any("DeepSpeed has no per-op checkpointing policy" in n for n in ds.notes)
    assert not any("selectively" in n for n in export_plan(_with_blocks([True] * 4), "deepspeed", info).notes)


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_fsdp2_export_checkpoints_selectively_like_apply_plan(fake_world):
    from shard_planner.execute.apply import apply_plan, describe_sharding

    plan = gpt2_plan([Unit(("",), False), Unit(("blocks.0",), True, SEL), Unit(("blocks.1",), True, True),
                      *(Unit((f"blocks.{i}",), True, SEL) for i in (2, 3))])
    mf = load_model_file(GPT2)
    reference = describe_sharding(apply_plan(mf.build(), plan, fake_world))
    source = export_plan(plan, "fsdp2").text
    namespace: dict = {}
    exec(compile(source, "apply_sharding.py", "exec"), namespace)
    model = namespace["apply_sharding"](mf.build(), fake_world)
    assert [u.modules for u in describe_sharding(model)] == [u.modules for u in reference]
    assert [u.activation_checkpoint for u in reference if u.modules != ("",)] == [SEL, True, SEL, SEL]
    # the generated policy keeps exactly the ops of the saved classes, by the tracer's classification
    saved = namespace["SAVED_OPS"]
    for func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.gelu.default,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, torch.ops.aten.add.Tensor):
        kept = namespace["_save_policy"](None, func).name == "MUST_SAVE"
        assert kept == (op_class(func, torch.empty(1)) in ("matmul", "attention_fwd")), func
    assert "mm" in saved
    inputs, targets = mf.batch(2)
    mf.loss(model(*inputs), targets).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_torchtitan_op_policy_plan_exports_as_op_without_a_difference_note():
    from shard_planner.plan.checkpointing import TORCHTITAN_OP_SAVE_OPS
    export = export_plan(_with_blocks([SEL] * 4, TORCHTITAN_OP_SAVE_OPS), "torchtitan")
    assert torchtitan_settings(export.text)["ACTIVATION_CHECKPOINT"] == "selective"
    assert not any("every second mm" in n or "saves op classes" in n for n in export.notes), export.notes


def test_fsdp2_export_keeps_every_other_matmul_under_the_torchtitan_policy():
    """The generated policy numbers the matmuls of each checkpointed call: 1st, 3rd, ... kept, the 2nd
    recomputed, attention kept, elementwise recomputed; each call starts its count afresh."""
    from shard_planner.plan.checkpointing import TORCHTITAN_OP_SAVE_OPS
    source = export_plan(_with_blocks([SEL] * 2, TORCHTITAN_OP_SAVE_OPS), "fsdp2").text
    namespace: dict = {}
    exec(compile(source, "apply_sharding.py", "exec"), namespace)
    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    for _ in range(2):
        policy = namespace["_policy"]()
        kept = [policy(None, f).name == "MUST_SAVE" for f in (mm, add, mm, sdpa, mm, mm)]
        assert kept == [True, False, False, True, True, False]
    assert "mm" in namespace["ALTERNATE_OPS"] and "mm" not in namespace["SAVED_OPS"]
