"""The single-device engine (plan/engine.py ``SINGLE``; cost/engines/single.py [Note: The single-device step]):
one device, plain PyTorch, every floating parameter cast to the compute dtype, gradients held in ``.grad``
until ``zero_grad``, no gathers, collectives or FSDP2 hooks. Priced on a hand-written decoder whose
parameters are built in fp32 (tests/models/cost_synth.py), against the rules stated in bytes."""

from dataclasses import replace

import pytest

from shard_planner.cost import CostModel
from shard_planner.errors import PlanError
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.plan.engine import FSDP2, SINGLE
from tests.models.cost_synth import synthetic_trace

LAYERS, HIDDEN, SEQ, VOCAB = 4, 1024, 512, 4096


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(LAYERS, HIDDEN, SEQ, VOCAB)


def _plan(trace, engine=SINGLE, *, ac=(), per_block=True, accumulation=1, micro_batch=1) -> Plan:
    layers = [m.fqn for m in trace.modules if m.type_name in ("Block", "TransformerBlock")]
    units = (Unit(("",), False),) + (tuple(Unit((fqn,), False, i in ac) for i, fqn in enumerate(layers))
                                     if per_block else ())
    training = Training(micro_batch, stored_dtype="bfloat16" if engine == SINGLE else None,
                        accumulation_steps=accumulation)
    return Plan(model=ModelRef("synthetic", trace.fingerprint), cluster=Cluster(1, 1, "h100-80gb", 80 * 2**30),
                mesh=Mesh(1), training=training, units=units, prefetch=Prefetch(), engine=engine)


def _categories_over_step(cm: CostModel, plan: Plan) -> dict[str, float]:
    """Per memory category, its largest value at any event of the step's timeline."""
    out: dict[str, float] = {}
    for event in cm.estimate(plan, timeline=True).memory.timeline:
        for k, v in event.bytes_by_category.items():
            out[k] = max(out.get(k, 0.0), v)
    return out


def test_the_parameters_are_held_once_in_the_compute_dtype_and_nothing_is_gathered(trace, h100):
    built_bytes = sum(m.param_bytes for m in trace.modules)
    assert all(set(m.param_bytes_by_dtype) <= {"float32"} for m in trace.modules)  # built in fp32
    cm = CostModel(trace, h100)
    seen = _categories_over_step(cm, _plan(trace))
    assert seen["sharded_params"] == built_bytes / 2  # cast to bf16: half, held once
    assert seen.get("unsharded_params", 0) == 0 and seen.get("comm_buffers", 0) == 0
    # AdamW: two states per trainable element in the parameter's (compute) dtype
    assert seen["optimizer_states"] == built_bytes  # 2 x 2 bytes per element = the fp32 bytes as built
    # every gradient is held in .grad until zero_grad: all of them live together at the optimizer step
    assert seen["grads"] == built_bytes / 2


def test_gradients_accumulate_in_place_over_micro_steps(trace, h100):
    cm = CostModel(trace, h100)
    one, three = cm.estimate(_plan(trace)).memory, cm.estimate(_plan(trace, accumulation=3)).memory
    seen = _categories_over_step(cm, _plan(trace, accumulation=3))
    assert seen["grads"] <= sum(m.param_bytes for m in trace.modules) / 2 + max(
        m.param_bytes for m in trace.modules)  # held once, one block's new gradients beside them at most
    assert three.peak_bytes < one.peak_bytes * 1.1


def test_no_collectives_and_no_per_unit_hooks(trace, h100):
    cm = CostModel(trace, h100)
    root_only, per_block = cm.estimate(_plan(trace, per_block=False)), cm.estimate(_plan(trace))
    for est in (root_only, per_block):
        assert est.time.comm_s == 0 and est.time.exposed_comm_s == pytest.approx(0, abs=1e-12)
    # the regions only say what is checkpointed: without any, one region or one per block is the same step
    assert per_block.time.step_time_s == pytest.approx(root_only.time.step_time_s, rel=1e-9)
    fsdp2 = cm.estimate(replace(_plan(trace), engine=FSDP2, training=Training(1)))
    assert fsdp2.time.step_time_s > per_block.time.step_time_s  # FSDP2's hooks and copies cost time


def test_checkpointing_trades_memory_for_recomputation(trace, h100):
    cm = CostModel(trace, h100)
    plain, checkpointed = cm.estimate(_plan(trace, micro_batch=4)), cm.estimate(_plan(trace, micro_batch=4,
                                                                                      ac=range(LAYERS)))
    assert checkpointed.memory.peak_bytes < plain.memory.peak_bytes
    assert checkpointed.time.compute_s > plain.time.compute_s


def test_one_gpu_without_fsdp2_needs_less_than_fsdp2_on_one_rank(h100):
    bf16 = synthetic_trace(LAYERS, HIDDEN, SEQ, VOCAB)  # FSDP2 at world size 1 still gathers each unit
    cm = CostModel(bf16, h100)
    single = cm.estimate(_plan(bf16, per_block=False)).memory.peak_bytes
    fsdp2 = cm.estimate(replace(_plan(bf16, per_block=False), engine=FSDP2,
                                training=Training(1, stored_dtype=None))).memory.peak_bytes
    assert single < fsdp2


@pytest.mark.parametrize("change, error", [
    (dict(mesh=Mesh(2), cluster=Cluster(2, 2, "h100-80gb", 2**30)), 'engine "single" trains on one device'),
    (dict(engine=FSDP2), "training.stored_dtype casts the model for engine \"single\" only"),
    (dict(training=Training(1, stored_dtype="bfloat16", accumulation_steps=2, gradient_sync="last_micro_step")),
     "are FSDP2's between micro-steps"),
])
def test_a_single_device_plan_file_is_consistent(trace, change, error):
    d = _plan(trace).to_dict()
    assert d["engine"] == SINGLE and d["training"]["stored_dtype"] == "bfloat16"
    assert Plan.from_dict(d) == _plan(trace)
    with pytest.raises(PlanError, match=error):
        replace(_plan(trace), **change)


def test_one_gpu_falls_back_to_fsdp2_offload_when_the_device_cannot_hold_the_model(h100, caplog):
    """The planner picks the single-device step at one GPU for a model stored in bf16, unless no plan of it fits:
    then FSDP2, whose CPU offload holds the state on the host (solve/planner.py ``plan_model``); asked for by
    name (--engine single) it says what fits instead."""
    from shard_planner.errors import InfeasibleError
    from shard_planner.solve import PlanRequest, plan_model

    built = synthetic_trace(4, 4096, 512, 32000)
    stored = replace(built, modules=tuple(replace(m, param_bytes_by_dtype={"bfloat16": b // 2 for b in
                                                                          m.param_bytes_by_dtype.values()})
                                          for m in built.modules))
    roomy = plan_model(stored, PlanRequest(gpus=1, mem_budget_bytes=12 * 2**30, profile=h100)).plan
    assert roomy.engine == SINGLE and not roomy.training.cpu_offload
    tight = plan_model(stored, PlanRequest(gpus=1, mem_budget_bytes=4 * 2**30, profile=h100)).plan
    assert tight.engine == FSDP2 and tight.training.cpu_offload
    assert "no single-device plan fits" in caplog.text
    with pytest.raises(InfeasibleError, match="or --engine fsdp2, whose CPU offload"):
        plan_model(stored, PlanRequest(gpus=1, mem_budget_bytes=4 * 2**30, profile=h100, engine=SINGLE))


def test_the_optimizer_in_backward_keeps_one_gradient_at_a_time(trace, h100):
    """[Note: Optimizer in backward]: each parameter stepped and its gradient freed as autograd accumulates it,
    so the gradients never pile up: at most the largest module's (as stored) at any event, and the peak no
    higher than with the step at the end (here, where the gradients of every block meet at the step, lower)."""
    cm = CostModel(trace, h100)
    plain = _plan(trace)
    fused = replace(plain, training=replace(plain.training, optimizer_in_backward=True))
    seen = _categories_over_step(cm, fused)
    largest = max(m.param_bytes for m in trace.modules) / 2  # stored in bf16
    assert 0 < seen["grads"] <= largest
    assert cm.estimate(fused).memory.peak_bytes < cm.estimate(plain).memory.peak_bytes
    assert fused.to_dict()["training"]["optimizer_in_backward"] is True
    assert "optimizer_in_backward" not in plain.to_dict()["training"]
    assert Plan.from_dict(fused.to_dict()) == fused
    with pytest.raises(PlanError, match="engine \"single\" only, without accumulation"):
        replace(fused, training=replace(fused.training, accumulation_steps=2))


def test_the_optimizer_steps_plain_tensors_at_their_own_overhead(trace, h100):
    """FSDP2's optimizer steps DTensors (the profile's per_param_tensor_optimizer_overhead_s), one device plain
    tensors (plain_tensor_optimizer_overhead_s): each trainable parameter tensor's step costs the difference less."""
    dtensor_s, plain_s = 300e-6, 25e-6
    profiles = [replace(h100, per_param_tensor_optimizer_overhead_s=dtensor_s, plain_tensor_optimizer_overhead_s=p)
                for p in (None, plain_s)]
    # the hand-written trace counts no tensors: a weight and a bias for every module with parameters
    trace = replace(trace, modules=tuple(replace(m, param_tensors=2 if m.param_bytes else 0)
                                         for m in trace.modules))
    tensors = sum(m.trainable_param_tensors for m in trace.modules)
    single = [CostModel(trace, p).estimate(_plan(trace)).time for p in profiles]
    fsdp2 = [CostModel(trace, p).estimate(_plan(trace, FSDP2)).time for p in profiles]
    assert fsdp2[0].optimizer_s == fsdp2[1].optimizer_s  # FSDP2 steps DTensors either way
    assert single[0].optimizer_s - single[1].optimizer_s == pytest.approx(tensors * (dtensor_s - plain_s))
    assert single[0].step_time_s - single[1].step_time_s == pytest.approx(tensors * (dtensor_s - plain_s))
