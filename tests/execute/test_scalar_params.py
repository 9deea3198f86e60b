"""0-d parameters (CLIP's ``logit_scale``): traced apart, held whole on every rank by the cost model,
replicated (never sharded) by apply_plan, and their gradients averaged over the ranks so that a 2-rank
run's losses match one process. See [Note: 0-d parameters] in shard_planner/execute/apply.py."""

import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor

from shard_planner.cost import cost_tables, model_state_bytes, plan_unit_bytes
from shard_planner.execute import apply_plan, build_mesh, describe_sharding, launch_plans
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Unit
from shard_planner.solve import plan_model
from shard_planner.solve.request import PlanRequest
from shard_planner.trace import trace_model
from tests.execute.test_run import make_plan, reference_losses
from tests.models.solve_traces import profile

MODEL = "tests/models/exec_scalar.py"
LAYERS = 4
BLOCKS = [f"blocks.{i}" for i in range(LAYERS)]


@pytest.fixture(scope="module")
def trace():
    return trace_model(MODEL, dtype="float32")


def test_the_trace_records_0d_parameters_apart(trace):
    assert trace.module("").scalar_param_bytes_by_dtype == {"float32": 4}
    for b in BLOCKS:
        assert trace.module(b).scalar_param_bytes_by_dtype == {"float32": 4}
        assert trace.module(b).sharded_param_bytes_by_dtype == {}  # the gate is the block's only own one
    assert trace.module("head").scalar_param_bytes_by_dtype == {}
    assert trace.module("head").sharded_param_bytes_by_dtype == trace.module("head").param_bytes_by_dtype


@pytest.mark.parametrize("world", [2, 8])
def test_the_cost_model_holds_0d_parameters_whole(trace, world):
    """Sharded state = the other parameters / N + the 0-d ones whole (5 x 4 bytes), exactly; the 0-d
    ones are never gathered or reduce-scattered."""
    plan = make_plan([Unit(("",), True), *(Unit((b,), True) for b in BLOCKS)], world)
    model = load_model_file(MODEL).build()
    scalars = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 0)
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() > 0)
    assert scalars == 5 * 4
    t = cost_tables(trace, plan.units)
    ub = plan_unit_bytes(t, plan)
    assert sum(x.sharded for x in ub) == pytest.approx(rest / world + scalars, abs=1e-9)
    assert sum(x.sharded_grad for x in ub) == pytest.approx(rest / world + scalars, abs=1e-9)
    assert sum(x.unsharded for x in ub) == rest  # fp32 plan: the all-gathers hold only the sharded ones
    states = model_state_bytes(trace, plan)
    assert states["sharded_params"] == round(rest / world + scalars)
    assert states["optimizer_states"] == round(2 * (rest / world + scalars))  # AdamW: 2 fp32 states


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_a_planned_model_with_0d_parameters_applies_and_trains(fake_world, trace):
    plan = plan_model(trace, PlanRequest(gpus=8, mem_budget_bytes=2**30, profile=profile(), micro_batch=2,
                                         param_dtype="float32", model_path=MODEL)).plan
    mf = load_model_file(MODEL)
    model = apply_plan(mf.build(), plan, build_mesh(plan, "cpu"))
    assert {u.modules for u in describe_sharding(model)} == {u.modules for u in plan.units}
    params = dict(model.named_parameters())
    for name, p in params.items():
        scalar = name == "logit_scale" or name.endswith(".gate")
        assert isinstance(p, DTensor) != scalar, name
    inputs, targets = mf.batch(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mf.loss(model(*inputs), targets).backward()
    assert params["logit_scale"].grad is not None and params["logit_scale"].grad.dim() == 0
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt.step()  # plain 0-d tensors and DTensors in one optimizer


@pytest.mark.multiprocess
def test_loss_matches_single_process_with_0d_parameters_world_size_2():
    plans = [
        make_plan([Unit(("",), False), *(Unit((b,), True) for b in BLOCKS)], 2, model=MODEL, prefetch=(1, 1)),
        # grouped and checkpointed units, bf16 compute (the 0-d parameters stay fp32)
        make_plan([Unit(("",), True), Unit(tuple(BLOCKS[:2]), True, True), Unit(tuple(BLOCKS[2:]), False)], 2,
                  model=MODEL, param_dtype="bfloat16", reduce_dtype="float32"),
    ]
    result = launch_plans(plans, steps=2, warmup=1, device="cpu", timeout_s=240)
    for i, (plan, m) in enumerate(zip(plans, result.measurements)):
        ref = reference_losses(plan, 2, 4)
        tol = 1e-3 if plan.training.param_dtype == "bfloat16" else 1e-5
        assert m.losses == pytest.approx(ref, rel=tol), i
