"""Gradient accumulation in the cost model (cost/accumulation.py) and the plan file, on hand-written
traces: the time of each policy against the single step's parts (exact on a CPU profile, where nothing
overlaps), what each policy holds between micro-steps, and plan files with and without the fields."""

import pytest

from shard_planner.cost import CostModel
from shard_planner.cost.accumulation import micro_steps
from shard_planner.errors import PlanError
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Training, Unit
from shard_planner.hardware.profile import load_profile
from tests.models import solve_traces

EVERY, LAST = "every_micro_step", "last_micro_step"


def _trace_plan(n=1, sync=EVERY, keep=False, *, mb=2, gpus=8, pd="bfloat16"):
    """solve_traces' 4-layer stack, one unit per layer (resharded), embed and head units, the root kept."""
    trace = solve_traces.stack_trace(4)
    units = (Unit(("",), False), Unit(("embed",)), *(Unit((f"layers.{i}",)) for i in range(4)), Unit(("head",)))
    plan = Plan(ModelRef(trace.model_path, trace.fingerprint, trace.tokens_per_sample),
                Cluster(gpus, 8, "test", 80 * 2**30), Mesh(gpus),
                Training(mb, "adamw", pd, "float32", accumulation_steps=n, gradient_sync=sync,
                         keep_params_gathered=keep), units)
    return trace, plan


@pytest.fixture(scope="module")
def gloo():
    return load_profile("cpu-gloo")


def test_micro_steps_first_middle_last():
    assert [(s.number, s.repeats, s.sync, s.gathered, s.keep) for s in micro_steps(Training(1, accumulation_steps=5,
            gradient_sync=LAST, keep_params_gathered=True))] == [
        (1, 1, False, False, True), (2, 3, False, True, True), (5, 1, True, True, False)]
    assert [(s.number, s.repeats) for s in micro_steps(Training(1, accumulation_steps=2))] == [(1, 1), (2, 1)]
    assert len(micro_steps(Training(1))) == 1


def test_cpu_time_is_n_micro_steps_less_what_each_policy_skips(gloo):
    """CPU (gloo): nothing overlaps, so each policy's saving is exactly the collectives it skips: deferred
    sync the reduce-scatters of n-1 micro-steps, kept parameters the forward all-gathers of n-1."""
    n = 4
    trace, one = _trace_plan(1)
    cm = CostModel(trace, gloo)
    t1 = cm.time(one)
    per_micro = t1.step_time_s - t1.optimizer_s
    rs = sum(u.reduce_scatter_s for u in t1.units)
    # each unit here reshards after forward: its all-gather time is forward + backward, half each
    ag_fwd = sum(u.all_gather_s for u, unit in zip(t1.units, one.units)
                 if unit.reshard_after_forward is False) + sum(
        u.all_gather_s / 2 for u, unit in zip(t1.units, one.units) if unit.reshard_after_forward is not False)
    times = {}
    for sync in (EVERY, LAST):
        for keep in (False, True):
            _, p = _trace_plan(n, sync, keep)
            times[sync, keep] = cm.time(p)
    every = times[EVERY, False]
    assert every.step_time_s == pytest.approx(n * per_micro + t1.optimizer_s, rel=1e-9)
    assert every.optimizer_s == pytest.approx(t1.optimizer_s)
    assert every.step_time_s - times[LAST, False].step_time_s == pytest.approx((n - 1) * rs, rel=1e-6)
    assert every.step_time_s - times[EVERY, True].step_time_s == pytest.approx((n - 1) * ag_fwd, rel=1e-6)
    assert rs > 0 and ag_fwd > 0
    # throughput counts the whole global batch: micro-batch x steps x ranks per optimizer step
    for t in times.values():
        assert t.samples_per_s == pytest.approx(2 * n * 8 / t.step_time_s)
        assert t.tokens_per_s == pytest.approx(t.samples_per_s * trace.tokens_per_sample)
    assert every.mfu == pytest.approx(t1.mfu * t1.step_time_s * n / every.step_time_s)


def test_gpu_deferred_sync_is_not_slower(gloo):
    profile = solve_traces.profile(busbw=5e9)  # slow links: communication shows
    trace, every = _trace_plan(8, EVERY)
    _, deferred = _trace_plan(8, LAST)
    cm = CostModel(trace, profile)
    assert cm.time(deferred).step_time_s <= cm.time(every).step_time_s
    assert cm.time(deferred).comm_s < cm.time(every).comm_s


def test_memory_held_between_micro_steps(gloo):
    """At the start of micro-step 2 a deferred plan holds every unit's unsharded gradients in the reduce
    dtype (fp32 here), a plan that syncs every micro-step only the sharded ones; kept parameters are all
    gathered there."""
    trace, every = _trace_plan(3, EVERY)
    cm = CostModel(trace, gloo)
    ub = cm.unit_bytes(every)
    starts = {}
    for name, plan in {"every": every, "deferred": _trace_plan(3, LAST)[1],
                       "kept": _trace_plan(3, EVERY, True)[1]}.items():
        mem = cm.memory(plan)
        first = next(e for e in mem.timeline if e.label.startswith("micro-step 2/3"))
        starts[name] = (first.bytes_by_category, mem.peak_bytes)
    assert starts["every"][0]["grads"] == pytest.approx(sum(x.sharded_grad for x in ub), abs=len(ub))
    assert starts["deferred"][0]["grads"] == pytest.approx(sum(x.rs_input for x in ub), abs=len(ub))
    assert starts["kept"][0]["unsharded_params"] == pytest.approx(sum(x.unsharded for x in ub), abs=len(ub))
    assert starts["every"][0]["unsharded_params"] == 0
    assert starts["deferred"][1] > starts["every"][1]  # the held gradients raise the peak
    # without accumulation the estimate is the single step's (the accumulated walk is not used)
    _, one = _trace_plan(1)
    assert not any(e.label.startswith("micro-step") for e in cm.memory(one).timeline)


# ---- the plan file ----

def test_plan_without_accumulation_writes_and_reads_as_before():
    _, one = _trace_plan(1)
    d = one.to_dict()
    assert not {"accumulation_steps", "gradient_sync", "keep_params_gathered"} & set(d["training"])
    assert Plan.from_dict(d) == one


def test_plan_with_accumulation_round_trips_and_says_its_global_batch():
    _, p = _trace_plan(4, LAST, True, mb=2, gpus=8)
    d = p.to_dict()
    assert d["training"]["accumulation_steps"] == 4 and d["training"]["gradient_sync"] == LAST
    assert d["training"]["keep_params_gathered"] is True
    assert Plan.from_dict(d) == p
    assert p.global_batch_samples == 2 * 4 * p.mesh.world_size
    assert p.accumulation_text.startswith(f"global batch {2 * 4 * p.mesh.world_size} = micro-batch 2 x 4 micro-steps")


@pytest.mark.parametrize("training, message", [
    ({"accumulation_steps": 0}, "training.accumulation_steps must be a positive integer, got 0"),
    ({"accumulation_steps": 2, "gradient_sync": "never"}, "training.gradient_sync must be one of"),
    ({"accumulation_steps": 1, "gradient_sync": LAST}, "apply between micro-steps"),
    ({"accumulation_steps": 1, "keep_params_gathered": True}, "apply between micro-steps"),
])
def test_bad_accumulation_fields_name_the_field(training, message):
    _, p = _trace_plan(1)
    d = p.to_dict()
    d["training"].update(training)
    with pytest.raises(PlanError, match=message.replace(".", r"\.")):
        Plan.from_dict(d)
