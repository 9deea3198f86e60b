"""Measured communication: the bytes each rank's collectives move per step, counted in real FSDP2 runs on
CPU/gloo, equal the cost model's prediction (cost/comm_bytes.py) exactly, for every kind of decision."""

import pytest
import torch
import torch.distributed as dist

from shard_planner.plan.comm import CollectiveBytes
from shard_planner.execute import launch_plans
from shard_planner.execute.comm_count import CommCounter, unit_param_shapes
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Unit
from tests.execute.test_run import make_plan

ODD = "tests/models/exec_odd.py"  # dim 0 of 61 and 33: every shard padded at 2 and 4 ranks
SCALAR = "tests/models/exec_scalar.py"  # 0-d parameters, all-reduced
BLOCKS = [f"blocks.{i}" for i in range(4)]


def test_counter_counts_message_bytes_once_and_restores_torch_distributed(fake_world):
    original = dist.all_gather_single
    counter = CommCounter()
    with counter:
        out, inp = torch.empty(6), torch.empty(3)
        dist.all_gather_single(out, inp)  # the whole output: 6 x 4 bytes (what FSDP2 calls)
        dist.reduce_scatter_single(inp, out)  # the whole input: 6 x 4 bytes
        dist.all_reduce(torch.empty(5, dtype=torch.bfloat16))
    assert dist.all_gather_single is original
    assert counter.take() == (CollectiveBytes("all_gather", 2, 1, 24), CollectiveBytes("all_reduce", 2, 1, 10),
                              CollectiveBytes("reduce_scatter", 2, 1, 24))
    assert counter.take() == ()
    dist.all_reduce(torch.empty(5))  # not counting outside the block
    assert counter.take() == ()


def test_unit_param_shapes_follow_fully_shards_ownership():
    model = load_model_file(SCALAR).build()
    plan = make_plan([Unit(("",), False), Unit(("blocks.0",)), Unit(("blocks.0.mlp",))], 2, model=SCALAR)
    per_unit, scalars = unit_param_shapes(model, plan)
    mlp = sum(p.numel() for p in model.blocks[0].mlp.parameters())
    norm = sum(p.numel() for p in model.blocks[0].norm.parameters())
    assert sum(p.numel for p in per_unit[2]) == mlp  # the nested unit owns its module's parameters
    assert sum(p.numel for p in per_unit[1]) == norm  # its parent keeps the rest (gate is 0-d)
    assert len(scalars) == 5 and all(p.numel == 1 for p in scalars)  # 4 gates + logit_scale
    assert sum(p.numel for ps in per_unit for p in ps) + len(scalars) == sum(p.numel() for p in model.parameters())


PLANS_2 = {
    "reshard true/false, grouped, prefetch 2": dict(units=[
        Unit(("",), True), Unit(("embed",), False), Unit(("blocks.0", "blocks.1")), Unit(("blocks.2",), False),
        Unit(("blocks.3",)), Unit(("head",))], prefetch=(2, 2)),
    "nested units, checkpointed": dict(units=[
        Unit(("",), False), Unit(("blocks.0",), True, True), Unit(("blocks.0.mlp",), True),
        Unit(("blocks.1",), False, True), Unit(("blocks.1.mlp",), True, True), Unit(("blocks.2", "blocks.3"))],
        prefetch=(1, 1)),
    "bf16 params, fp32 reduce": dict(units=[Unit(("",), True), *(Unit((b,), True) for b in BLOCKS)],
                                     param_dtype="bfloat16", reduce_dtype="float32"),
    "HSDP 2 replicas x 1": dict(units=[Unit(("",), True), Unit(("blocks.0", "blocks.1")), Unit(("blocks.2",))],
                                replicate=2),
}


def _check_exact(name, m):
    assert m.comm_predicted, name
    assert m.comm_same_every_step, name
    assert m.comm_measured == m.comm_predicted, (name, m.comm_comparison())
    assert m.comm_matches, name


@pytest.mark.multiprocess
def test_measured_bytes_equal_predicted_world_size_2():
    names = list(PLANS_2)
    plans = [make_plan(world_size=2, model=ODD, **PLANS_2[n]) for n in names]
    plans.append(make_plan([Unit(("",), False), *(Unit((f"blocks.{i}",)) for i in range(4))], 2, model=SCALAR))
    names.append("0-d parameters")
    result = launch_plans(plans, steps=2, warmup=1, device="cpu", timeout_s=240)
    for name, m in zip(names, result.measurements):
        _check_exact(name, m)
    by_name = dict(zip(names, result.measurements))
    kinds = {n: {(c.collective, c.group_size) for c in m.comm_measured} for n, m in by_name.items()}
    assert kinds["HSDP 2 replicas x 1"] == {("all_reduce", 2)}  # a 1-rank shard group moves nothing
    assert ("all_reduce", 2) in kinds["0-d parameters"]
    # bf16 gathers half the bytes of the fp32 reduce-scatter, twice (every unit reshards)
    bf16 = {c.collective: c.bytes for c in by_name["bf16 params, fp32 reduce"].comm_measured}
    assert bf16["all_gather"] == bf16["reduce_scatter"]


@pytest.mark.multiprocess
def test_measured_bytes_equal_predicted_world_size_4_int_reshard_and_hsdp():
    plans = [make_plan([Unit(("",), False), *(Unit((b,), 2) for b in BLOCKS)], 4, model=ODD, prefetch=(1, 2)),
             make_plan([Unit(("",), True), Unit(("blocks.0", "blocks.1")), Unit(("blocks.2", "blocks.3"))], 4,
                       model=ODD, replicate=2)]
    result = launch_plans(plans, steps=1, warmup=1, device="cpu", timeout_s=300)
    for name, m in zip(("int reshard", "HSDP 2x2"), result.measurements):
        _check_exact(name, m)
    groups = {(c.collective, c.group_size) for c in result.measurements[0].comm_measured}
    assert ("all_gather", 2) in groups and ("all_gather", 4) in groups  # backward over the 2-rank group


@pytest.mark.multiprocess
def test_measured_bytes_equal_predicted_with_gradient_accumulation():
    """Per optimizer step of 3 micro-steps: every micro-step gathers and reduces; deferred sync reduces
    once; parameters kept gathered skip the forward all-gathers of micro-steps 2 and 3; the 0-d
    parameters' all-reduce runs every micro-step."""
    units = [Unit(("",), False), Unit(("embed",), False), Unit(("blocks.0", "blocks.1")), Unit(("blocks.2",), 2),
             Unit(("blocks.3",)), Unit(("head",))]
    policies = {"sync every micro-step": ("every_micro_step", False), "deferred sync": ("last_micro_step", False),
                "deferred sync, parameters kept": ("last_micro_step", True)}
    plans = [make_plan(units, 4, model=ODD, prefetch=(1, 1), accumulation_steps=3, gradient_sync=sync,
                       keep_params_gathered=keep) for sync, keep in policies.values()]
    plans.append(make_plan([Unit(("",), False), *(Unit((f"blocks.{i}",)) for i in range(4))], 4, model=SCALAR,
                           accumulation_steps=2, gradient_sync="last_micro_step"))
    names = [*policies, "0-d parameters, deferred sync"]
    result = launch_plans(plans, steps=1, warmup=1, device="cpu", timeout_s=300)
    for name, m in zip(names, result.measurements):
        _check_exact(name, m)
    rs = {n: sum(c.bytes for c in m.comm_measured if c.collective == "reduce_scatter")
          for n, m in zip(names, result.measurements)}
    assert rs["sync every micro-step"] == 3 * rs["deferred sync"]
    ag = {n: sum(c.bytes for c in m.comm_measured if c.collective == "all_gather")
          for n, m in zip(names, result.measurements)}
    assert ag["deferred sync, parameters kept"] < ag["deferred sync"]
