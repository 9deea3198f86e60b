"""Gradient accumulation in real FSDP2 runs (CPU/gloo, world size 2): n micro-steps per optimizer step
give the losses of one single-process step over the whole global batch (the mean loss over every rank's
micro-batches of every micro-step: tests/execute/test_run.py's reference_losses), for each gradient-sync
policy and with parameters kept gathered.
Plain SGD: its update is proportional to the gradient, so a gradient off by the 1/n scale (or a
micro-step's gradients lost or counted twice) changes every later loss."""

from dataclasses import replace

import pytest

from shard_planner.execute import launch_plans
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.trace.structure import model_fingerprint
from tests.execute.test_run import reference_losses

MODEL = "tests/models/exec_net.py"
BLOCKS = [f"blocks.{i}" for i in range(6)]


def _plan(n: int, sync: str, keep: bool, param_dtype: str = "float32") -> Plan:
    fp = model_fingerprint(load_model_file(MODEL).build())
    units = [Unit(("",), False), Unit(("embed",)), *(Unit((b,)) for b in BLOCKS), Unit(("head",))]
    return Plan(ModelRef(MODEL, fp), Cluster(2, 8, "cpu-gloo", 2**30), Mesh(2),
                Training(2, "sgd", param_dtype, "float32", lr=0.5, accumulation_steps=n, gradient_sync=sync,
                         keep_params_gathered=keep),
                tuple(units), Prefetch(1, 1))


@pytest.mark.multiprocess
def test_accumulated_steps_match_one_big_batch_world_size_2():
    plans = {
        "3 micro-steps, sync every micro-step": _plan(3, "every_micro_step", False),
        "3 micro-steps, deferred sync": _plan(3, "last_micro_step", False),
        "2 micro-steps, deferred sync, parameters kept gathered": _plan(2, "last_micro_step", True),
        "2 micro-steps, sync every step, parameters kept, bf16": _plan(2, "every_micro_step", True, "bfloat16"),
    }
    steps, warmup = 2, 1
    result = launch_plans(list(plans.values()), steps=steps, warmup=warmup, device="cpu", timeout_s=300)
    n_steps = warmup + steps + 1  # + the storage-tracked step on CPU
    for (name, plan), m in zip(plans.items(), result.measurements):
        ref = reference_losses(plan, 2, n_steps)
        assert len(m.losses) == n_steps, name
        # the first step's loss is before any update; the later ones follow the accumulated updates
        tol = 2e-3 if plan.training.param_dtype == "bfloat16" else 1e-5
        assert m.losses == pytest.approx(ref, rel=tol), name
    # summed instead of averaged, the micro-steps' gradients would take SGD steps 3x as large: the same as the
    # big batch at 3x the learning rate, which the run must not match
    every = plans["3 micro-steps, sync every micro-step"]
    summed = reference_losses(replace(every, training=replace(every.training, lr=3 * every.training.lr)), 2, n_steps)
    assert summed[1:] != pytest.approx(result.measurements[0].losses[1:], rel=1e-3)
