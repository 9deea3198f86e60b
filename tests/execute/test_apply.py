"""apply_plan in one process with the fake process group: the FSDP2 units, reshard settings, prefetch
lists and checkpointing are exactly the plan's, at world sizes 8-64; mismatches are clear PlanErrors."""

import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from shard_planner.errors import PlanError
from shard_planner.execute import apply_plan, build_mesh, describe_sharding
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.trace.structure import model_fingerprint

MODEL = "tests/models/exec_net.py"


def model_and_fingerprint():
    model = load_model_file(MODEL).build()
    return model, model_fingerprint(model)


def make_plan(units, world_size, fingerprint, *, replicate=1, prefetch=(0, 1), **training):
    mesh = Mesh(shard=world_size // replicate, replicate=replicate)
    return Plan(ModelRef(MODEL, fingerprint), Cluster(world_size, 8, "h100-80gb", 80 * 2**30), mesh,
                Training(4, **training), tuple(units), Prefetch(*prefetch))


UNITS = (
    Unit(("",), reshard_after_forward=False),
    Unit(("embed",), reshard_after_forward=False),
    Unit(("blocks.0", "blocks.1"), reshard_after_forward=4, activation_checkpoint=True),
    Unit(("blocks.2",), reshard_after_forward=True),
    Unit(("blocks.2.mlp",), reshard_after_forward=True, activation_checkpoint=True),
    Unit(("blocks.3", "blocks.4", "blocks.5"), reshard_after_forward=False),
    Unit(("head",), reshard_after_forward=True),
)


@pytest.mark.parametrize("fake_world", [8, 16, 64], indirect=True)
def test_units_reshard_and_prefetch_are_the_plans(fake_world):
    model, fp = model_and_fingerprint()
    plan = make_plan(UNITS, fake_world.size(), fp, prefetch=(2, 3))
    apply_plan(model, plan, build_mesh(plan, "cpu"))
    got = {u.modules: u for u in describe_sharding(model)}
    assert set(got) == {u.modules for u in UNITS}
    for unit in UNITS:
        assert got[unit.modules].reshard_after_forward == unit.reshard_after_forward, unit.name
        assert got[unit.modules].activation_checkpoint == unit.activation_checkpoint, unit.name
    # Forward order: root first, then the plan's order; each unit prefetches the next 2.
    g01, g345 = ("blocks.0", "blocks.1"), ("blocks.3", "blocks.4", "blocks.5")
    fwd = {u: got[u].forward_prefetch for u in got}
    assert fwd[("",)] == (("embed",), g01)
    assert fwd[("embed",)] == (g01, ("blocks.2",))
    assert fwd[g01] == (("blocks.2",), ("blocks.2.mlp",))
    assert fwd[("blocks.2.mlp",)] == (g345, ("head",))
    assert fwd[g345] == (("head",),)
    assert fwd[("head",)] == ()
    # Backward order: the reverse, without the root; each unit prefetches the next 3.
    bwd = {u: got[u].backward_prefetch for u in got}
    assert bwd[("head",)] == (g345, ("blocks.2.mlp",), ("blocks.2",))
    assert bwd[("blocks.2",)] == (g01, ("embed",))
    assert bwd[("embed",)] == ()
    assert bwd[("",)] == ()


@pytest.mark.parametrize("fake_world", [16], indirect=True)
def test_hsdp_plan_gets_a_2d_mesh_and_trains(fake_world):
    model, fp = model_and_fingerprint()
    units = (Unit(("",), False), *(Unit((f"blocks.{i}",), 2) for i in range(6)))
    plan = make_plan(units, fake_world.size(), fp, replicate=2, param_dtype="float32")
    mesh = build_mesh(plan, "cpu")
    assert tuple(mesh.shape) == (2, 8) and mesh.mesh_dim_names == ("replicate", "shard")
    apply_plan(model, plan, mesh)
    got = {u.modules: u.reshard_after_forward for u in describe_sharding(model)}
    assert got == {u.modules: u.reshard_after_forward for u in units}
    param = next(model.blocks[0].parameters())
    assert tuple(param.device_mesh.shape) == (2, 8)  # sharded over 8, replicated over 2
    assert param.to_local().shape[0] == -(-param.shape[0] // 8)


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_checkpointed_units_recompute_in_backward(fake_world):
    model, fp = model_and_fingerprint()
    plan = make_plan(UNITS, fake_world.size(), fp, param_dtype="float32")
    apply_plan(model, plan, build_mesh(plan, "cpu"))
    calls = {}
    for name in ("blocks.0.mlp.up", "blocks.2.norm", "blocks.2.mlp.up", "blocks.3.mlp.up"):
        model.get_submodule(name).register_forward_hook(
            lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    mf = load_model_file(MODEL)
    inputs, targets = mf.batch(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mf.loss(model(*inputs), targets).backward()
    # blocks.0 (a checkpointed group) and blocks.2.mlp run twice; blocks.2.norm and blocks.3 once.
    assert calls == {"blocks.0.mlp.up": 2, "blocks.2.norm": 1, "blocks.2.mlp.up": 2, "blocks.3.mlp.up": 1}


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_mixed_precision_and_offload_policies(fake_world):
    model, fp = model_and_fingerprint()
    plan = make_plan(UNITS[:1], fake_world.size(), fp, param_dtype="bfloat16", reduce_dtype="float32", cpu_offload=True)
    apply_plan(model, plan, build_mesh(plan, "cpu"))
    group = model._get_fsdp_state()._fsdp_param_group
    assert group.mp_policy.param_dtype == torch.bfloat16 and group.mp_policy.reduce_dtype == torch.float32
    assert type(group.offload_policy).__name__ == "CPUOffloadPolicy" and group.offload_policy.pin_memory is False


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_mismatches_are_plan_errors_that_say_what_differs(fake_world):
    model, fp = model_and_fingerprint()
    mesh = init_device_mesh("cpu", (8,))

    def err(units, fingerprint=fp, world=8):
        with pytest.raises(PlanError) as info:
            apply_plan(load_model_file(MODEL).build(), make_plan(units, world, fingerprint), mesh)
        return str(info.value)

    root = Unit(("",))
    assert "'blocks.9'" in err((root, Unit(("blocks.9",))))
    msg = err((root,), fingerprint="0123456789abcdef")
    assert "0123456789abcdef" in msg and fp in msg
    assert "siblings" in err((root, Unit(("blocks.0", "head"))))
    assert "contiguous" in err((root, Unit(("blocks.0", "blocks.2"))))
    assert "mesh of shape 16" in err((root,), world=16)
    plan = make_plan((root,), 8, fp)
    apply_plan(model, plan, mesh)
    with pytest.raises(PlanError, match="already sharded"):
        apply_plan(model, plan, mesh)


def _example_plan(path, units, world_size):
    model = load_model_file(path).build()
    plan = Plan(ModelRef(path, model_fingerprint(model)), Cluster(world_size, world_size, "cpu-gloo", 2**30),
                Mesh(shard=world_size), Training(2, param_dtype="float32"), tuple(units), Prefetch(0, 1))
    return model, plan


def _train_step(path, model, batch_size=2):
    mf = load_model_file(path)
    inputs, targets = mf.batch(batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = mf.loss(model(*inputs), targets)
        loss.backward()
    return loss


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_plan_splitting_tied_weights_is_a_plan_error(fake_world):
    path = "examples/gpt2.py"
    mesh = init_device_mesh("cpu", (2,))
    for split in (Unit(("wte",)), Unit(("lm_head",))):
        model, plan = _example_plan(path, (Unit(("",)), split), 2)
        assert model.lm_head.weight is model.wte.weight
        with pytest.raises(PlanError, match="splits tied weights") as info:
            apply_plan(model, plan, mesh)
        assert "'wte'" in str(info.value) and "'lm_head'" in str(info.value)
    # both in the root unit, blocks in their own: applies and trains
    model, plan = _example_plan(path, (Unit(("",)), *(Unit((f"blocks.{i}",)) for i in range(len(
        load_model_file(path).build().blocks)))), 2)
    apply_plan(model, plan, mesh)
    assert torch.isfinite(_train_step(path, model))


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_planned_unet_applies_and_trains(fake_world):
    """Plans for a model with a ModuleList that is never called (unet's ``downs``) wrap only modules
    whose forward runs; the plan applies and one forward/backward goes through FSDP2's hooks."""
    from shard_planner.hardware.profile import load_profile
    from shard_planner.solve import PlanRequest, plan_model
    from shard_planner.trace.tracer import trace_model

    path = "examples/unet.py"
    trace = trace_model(path)
    plan = plan_model(trace, PlanRequest(gpus=2, gpus_per_node=2, mem_budget_bytes=int(2 * 2**20 / 0.8),  # 2 MiB usable
                      profile=load_profile("cpu-gloo"),
                      micro_batch=2, param_dtype="float32", model_path=path, frontier_points=2)).plan
    assert all(trace.module(m).calls >= 1 for u in plan.units for m in u.modules)
    assert any(m.startswith("downs.") for u in plan.units for m in u.modules)  # a tight budget: many units
    model = load_model_file(path).build()
    apply_plan(model, plan, build_mesh(plan, "cpu"))
    assert torch.isfinite(_train_step(path, model))
