"""Gradient accumulation in the report and the exports: the memory timeline marks the micro-steps and the
gradients held between them (a deferred plan's extra gradient memory), the summary says the global
batch and policies, and every export carries the accumulation steps / global batch."""

import json
from dataclasses import replace

import pytest

from shard_planner.cost import CostModel
from shard_planner.execute.accumulate import set_micro_step
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.hardware.profile import load_profile
from shard_planner.report.accumulation import held_gradient_bytes, micro_step_spans
from shard_planner.report.budget import report_budget
from shard_planner.report.export import export_plan, model_info_for_plan
from shard_planner.report.export.fsdp2 import export_fsdp2
from shard_planner.report.timeline import plot_memory_timeline
from shard_planner.report.render import summary_lines
from shard_planner.model.modelfile import load_model_file
from shard_planner.trace.structure import model_fingerprint
from tests.models import solve_traces
from tests.report.test_export import torchtitan_settings

EVERY, LAST = "every_micro_step", "last_micro_step"
GPT2 = "examples/gpt2.py"


def _gid(fig, gid):
    return [a for a in fig.findobj() if getattr(a, "get_gid", lambda: None)() == gid]


def _stack_plan(n, sync, keep=False):
    trace = solve_traces.stack_trace(4)
    units = (Unit(("",), False), Unit(("embed",)), *(Unit((f"layers.{i}",)) for i in range(4)), Unit(("head",)))
    return trace, Plan(ModelRef(trace.model_path, trace.fingerprint, trace.tokens_per_sample),
                       Cluster(8, 8, "h100-80gb", 40 * 2**30), Mesh(8),
                       Training(2, accumulation_steps=n, gradient_sync=sync, keep_params_gathered=keep), units)


def test_timeline_marks_micro_steps_and_the_deferred_plans_held_gradients():
    profile = load_profile("h100-80gb")
    held = {}
    for sync in (EVERY, LAST):
        trace, plan = _stack_plan(4, sync)
        mem = CostModel(trace, profile).memory(plan)
        spans = micro_step_spans(mem.timeline)
        assert [(k, n) for k, n, _, _ in spans] == [(1, 4), (2, 4), (4, 4)]
        assert spans[0][2] == 0 and spans[-1][3] == len(mem.timeline) - 1
        held[sync] = held_gradient_bytes(mem.timeline)
        fig = plot_memory_timeline(mem, report_budget(plan, profile))
        assert len(_gid(fig, "micro-step:2")) == 1 and len(_gid(fig, "micro-step:4")) == 1
        assert len(_gid(fig, "held:2")) == 1 and len(_gid(fig, "held:4")) == 1
    # deferred sync holds every unit's unsharded fp32 gradients (1/N of them when synced every micro-step)
    (_, every_2), _ = held[EVERY]
    (_, deferred_2), _ = held[LAST]
    assert deferred_2 == pytest.approx(8 * every_2, rel=0.01)
    trace, one = _stack_plan(1, EVERY)
    assert micro_step_spans(CostModel(trace, profile).memory(one).timeline) == []


def test_summary_says_global_batch_and_policies():
    _, plan = _stack_plan(4, LAST, keep=True)
    trace, _ = _stack_plan(4, LAST)
    plan = replace(plan, predicted=CostModel(trace, load_profile("h100-80gb")).estimate(plan).prediction())
    lines = dict(summary_lines(plan, report_budget(plan, load_profile("h100-80gb"))))
    assert ("global batch 64 = micro-batch 2 x 4 micro-steps x 8 GPUs, gradients reduce-scattered on the last "
            "micro-step only, parameters kept gathered between them") in lines["training"]
    assert "predicted optimizer step" in lines


@pytest.fixture
def gpt2_accumulated(in_repository_root):
    fp = model_fingerprint(load_model_file(GPT2).build())
    units = (Unit(("",), False), *(Unit((f"blocks.{i}",)) for i in range(4)))
    return Plan(ModelRef(GPT2, fp, 64), Cluster(8, 8, "h100-80gb", 16 * 2**30), Mesh(8),
                Training(2, accumulation_steps=4, gradient_sync=LAST), units, Prefetch(1, 1))


def test_exports_carry_the_accumulation(gpt2_accumulated):
    plan = gpt2_accumulated
    info = model_info_for_plan(plan)
    ds = json.loads(export_plan(plan, "deepspeed", info).text)
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_batch_size"] == 2 * 4 * 8
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert any("ZeRO-3 reduces them every micro-step" in line for line in ds["_comment"])
    tt = export_plan(plan, "torchtitan")
    training = torchtitan_settings(tt.text)["TRAINING"]
    assert training["global_batch_size"] == 64 and training["local_batch_size"] == 2
    assert any("torchtitan reduces them every micro-step" in n for n in tt.notes)
    acc = export_plan(plan, "accelerate", info).text
    assert "Accelerator(gradient_accumulation_steps=4)" in acc and "last micro-step only, as planned" in acc
    every = replace(plan, training=replace(plan.training, gradient_sync=EVERY))
    assert "sync_each_batch=True" in export_plan(every, "accelerate", info).text
    # without accumulation the exports say one step, as before
    one = replace(plan, training=Training(2))
    assert json.loads(export_plan(one, "deepspeed", info).text)["gradient_accumulation_steps"] == 1
    assert "global_batch_size" not in torchtitan_settings(export_plan(one, "torchtitan").text)["TRAINING"]
    assert "train_step" not in export_fsdp2(one)


class _Recorder:
    """Stands in for the FSDP2 root and the optimizer: records the switches of each micro-step."""

    def __init__(self):
        self.calls = []

    def set_requires_gradient_sync(self, value, recurse=True):
        self.calls.append(("sync", value))

    def set_reshard_after_backward(self, value, recurse=True):
        self.calls.append(("reshard", value))


@pytest.mark.parametrize("sync, keep", [(LAST, True), (EVERY, False), (EVERY, True)])
def test_fsdp2_train_step_sets_what_the_executor_sets(gpt2_accumulated, sync, keep):
    import torch

    plan = replace(gpt2_accumulated, training=replace(gpt2_accumulated.training, gradient_sync=sync,
                                                      keep_params_gathered=keep))
    namespace: dict = {}
    exec(compile(export_fsdp2(plan), "fsdp2_export.py", "exec"), namespace)
    exported, executed = _Recorder(), _Recorder()

    class Model(torch.nn.Module):  # one weight: the loss's gradient says how each micro-step was scaled
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))
            self.set_requires_gradient_sync = exported.set_requires_gradient_sync
            self.set_reshard_after_backward = exported.set_reshard_after_backward

        def forward(self, x):
            return self.w * x

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    batches = [(torch.tensor(float(i + 1)), None) for i in range(4)]
    loss = namespace["train_step"](model, opt, batches, lambda out, _: out)
    for m in range(4):
        set_micro_step(executed, plan.training, m)
    assert exported.calls == executed.calls
    assert loss.item() == pytest.approx(2.5)  # the mean of the micro-steps' losses
    assert model.w.item() == pytest.approx(1 - 2.5)  # one SGD step on the mean gradient (1+2+3+4)/4
