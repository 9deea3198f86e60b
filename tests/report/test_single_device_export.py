"""Exports of a single-device plan (report/export/single.py): the PyTorch code casts the model and checkpoints the
planned modules without fully_shard (and steps the optimizer in backward when the plan says so), Accelerate gets a
one-process config without a distributed type, torchtitan and DeepSpeed refuse in one line."""

from dataclasses import replace

import pytest
import torch

from shard_planner.cli.main import main
from shard_planner.errors import UserError
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import load_plan
from shard_planner.report.export import export_plan
from tests.paths import EXAMPLES


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "plan.json"
    assert main(["plan", str(EXAMPLES / "vit.py"), "--gpus", "1", "--mem", "2GB", "--profile", "cpu-gloo", "--engine",
                 "single", "--batch-size", "1", "--no-report", "-o", str(out)]) == 0
    plan = load_plan(out)
    units = tuple(replace(u, activation_checkpoint=not u.is_root and i % 2 == 1) for i, u in enumerate(plan.units))
    return replace(plan, units=units, training=replace(plan.training, optimizer_in_backward=True))


def test_the_pytorch_code_casts_checkpoints_and_steps_in_backward(single):
    namespace: dict = {}
    exec(compile(export_plan(single, "fsdp2").text, "single_export.py", "exec"), namespace)
    assert "fully_shard" not in export_plan(single, "fsdp2").text
    mf = load_model_file(str(EXAMPLES / "vit.py"))
    model = namespace["prepare_model"](mf.build())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    checkpointed = [fqn for u in single.units if u.activation_checkpoint for fqn in u.modules]
    assert [name for name, _ in namespace["CHECKPOINTED"]] == checkpointed
    assert all(model.get_submodule(f).forward.__wrapped__ for f in checkpointed)  # functools.wraps'd
    optimizers = namespace["optimizer_in_backward"](model, torch.optim.AdamW, lr=1e-3)
    before = {p: p.detach().clone() for p in optimizers}
    inputs, targets = mf.batch(1)
    inputs = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs)
    mf.loss(mf.forward(model, inputs), targets).backward()
    assert all(p.grad is None for p in optimizers)  # stepped and freed in the backward
    assert any(not torch.equal(before[p], p.detach()) for p in optimizers)


def test_accelerate_gets_one_process_and_the_others_refuse(single):
    config = export_plan(single, "accelerate")
    assert 'distributed_type: "NO"' in config.text and "num_processes: 1" in config.text
    assert any("cast" in n for n in config.notes) and any("checkpointed regions" in n for n in config.notes)
    for target, why in (("torchtitan", "FSDP2 or autocast"), ("deepspeed", "ZeRO engine")):
        with pytest.raises(UserError, match=f"cannot export a single-device plan to {target}: .*{why}") as err:
            export_plan(single, target)
        assert "\n" not in str(err.value) and "--engine fsdp2" in str(err.value)
