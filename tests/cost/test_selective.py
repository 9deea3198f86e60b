"""Selective activation checkpointing in the plan contract, the trace and the cost model (pure, one process).

The torchtitan-style configuration (examples/llama.py Llama 3 8B, 8 GPUs, seq 8192, micro-batch 1, bf16,
one unit per block): selective AC is predicted between no AC and full AC in memory and in step time, and
the planner picks it where it is the fastest plan that fits."""

import json
from collections import Counter
from dataclasses import replace

import pytest

from shard_planner.plan.checkpointing import ALTERNATE_MATMUL, DEFAULT_SAVE_OPS, SAVEABLE_OP_CLASSES, TORCHTITAN_OP_SAVE_OPS
from shard_planner.cost import CostModel
from shard_planner.cost.kernels import OP_CLASSES
from shard_planner.cost.selective import subtree_selective, supports_selective, flops_price
from shard_planner.errors import PlanError
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.solve import PlanRequest, plan_model
from shard_planner.trace import trace_model
from shard_planner.trace.types import ModelTrace
from tests.paths import EXAMPLES

LLAMA = str(EXAMPLES / "llama.py")
GiB = 2**30


# ---- the plan contract ----

def test_unit_accepts_selective_with_save_ops_and_old_units_load_unchanged():
    old = {"modules": ["layers.0"], "reshard_after_forward": True, "activation_checkpoint": True}
    plan = _plan(trace=None, units=[Unit(("",), False), Unit(("layers.0",), True, "selective", ("matmul",))])
    d = json.loads(plan.to_json())
    assert d["units"][1]["activation_checkpoint"] == "selective" and d["units"][1]["ac_save_ops"] == ["matmul"]
    assert Plan.from_dict(d) == plan
    d["units"][1] = old  # a unit written before selective checkpointing: no ac_save_ops
    assert Plan.from_dict(d).units[1] == Unit(("layers.0",), True, True)
    assert Unit(("a",), True, "selective").ac_save_ops == DEFAULT_SAVE_OPS
    assert set(SAVEABLE_OP_CLASSES) - {ALTERNATE_MATMUL} <= set(OP_CLASSES) and set(DEFAULT_SAVE_OPS) <= set(SAVEABLE_OP_CLASSES)


@pytest.mark.parametrize("unit,message", [
    (dict(activation_checkpoint="op"), 'units[1].activation_checkpoint must be true, false or "selective", got "op"'),
    (dict(activation_checkpoint="selective", ac_save_ops=["mm"]), 'units[1].ac_save_ops[0] must be one of'),
    (dict(activation_checkpoint=True, ac_save_ops=["matmul"]), 'ac_save_ops is for activation_checkpoint "selective" only'),
])
def test_bad_checkpointing_fields_name_the_field(unit, message):
    d = json.loads(_plan(trace=None, units=[Unit(("",), False), Unit(("layers.0",))]).to_json())
    d["units"][1].update(unit)
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Plan.from_dict(d)


# ---- the trace and the cost model, on llama tiny ----

@pytest.fixture(scope="module")
def tiny():
    return trace_model(LLAMA, dtype="bfloat16")


def test_trace_records_new_storage_bytes_and_round_trips(tiny):
    assert supports_selective(tiny)
    blk = tiny.module("layers.0.attention.wq")
    (rec,) = blk.fwd_kernels
    # wq's mm output: (batch x seq, dim) in bf16 is its one new storage
    assert rec.op_class == "matmul" and rec.new_bytes.at(8) == 8 * 64 * 64 * 2
    assert ModelTrace.from_json(tiny.to_json()) == tiny
    # a block's output is a residual add: an elementwise storage of (batch, seq, dim)
    assert tiny.module("layers.1").output_bytes_by_class["elementwise"].at(8) == 8 * 64 * 64 * 2


def test_traces_without_new_bytes_offer_no_selective_candidates(tiny):
    from shard_planner.solve.space import build_space

    def strip(m):
        return replace(m, fwd_kernels=tuple(replace(r, new_bytes=None) for r in m.fwd_kernels))
    old = replace(tiny, modules=tuple(strip(m) for m in tiny.modules))
    assert not supports_selective(old)
    modes = lambda t: {c.option.activation_checkpoint for c in build_space(t, shard_group=2, gpus_per_node=2).candidates}
    assert modes(old) == {False, True} and modes(tiny) == {False, True, "selective"}


def test_stash_is_what_the_save_classes_allocate(tiny):
    b = 8
    stash, skipped, total = subtree_selective(tiny, "layers.0", ("matmul",), b, flops_price(b))
    mms = sum(r.new_bytes.at(b) for m in tiny.subtree("layers.0") for r in m.fwd_kernels if r.op_class == "matmul")
    assert stash == mms and 0 < skipped <= total
    none, _, _ = subtree_selective(tiny, "layers.0", (), b, flops_price(b))
    assert none == 0.0


def test_selective_lies_between_no_ac_and_full_on_llama_tiny(tiny, gloo):
    cm = CostModel(tiny, gloo)
    est = {ac: cm.estimate(_blocks_plan(tiny, ac, 2, 2, 32), timeline=False) for ac in (False, "selective", True)}
    peaks = [est[a].memory.peak_bytes for a in (False, "selective", True)]
    times = [est[a].time.step_time_s for a in (False, "selective", True)]
    assert peaks[0] > peaks[1] > peaks[2] and times[0] < times[1] < times[2]
    # keeping every op class holds at least what the op-level policy holds
    sel = _blocks_plan(tiny, "selective", 2, 2, 32)
    every = cm.estimate(replace(sel, units=tuple(replace(u, ac_save_ops=SAVEABLE_OP_CLASSES)
                                                 if u.activation_checkpoint else u for u in sel.units)), timeline=False)
    assert every.memory.peak_bytes >= peaks[1]


# ---- Llama 3 8B, 8 GPUs, seq 8192, micro-batch 1 (torchtitan's published configuration) ----

@pytest.fixture(scope="module")
def llama8b():
    import os
    saved = {k: os.environ.get(k) for k in ("SHARD_PLANNER_SIZE", "SHARD_PLANNER_SEQ")}
    os.environ.update(SHARD_PLANNER_SIZE="8b", SHARD_PLANNER_SEQ="8192")
    try:
        return trace_model(LLAMA, dtype="bfloat16")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("compute_model", ["flops", "roofline"])
def test_llama8b_selective_between_no_ac_and_full_in_memory_and_time(llama8b, h100, compute_model):
    profile = replace(h100, compute_model=compute_model)
    cm = CostModel(llama8b, profile)
    est = {ac: cm.estimate(_blocks_plan(llama8b, ac, 32, 8), timeline=False) for ac in (False, "selective", True)}
    peaks = [est[a].memory.peak_bytes for a in (False, "selective", True)]
    times = [est[a].time.step_time_s for a in (False, "selective", True)]
    assert peaks[0] > peaks[1] > peaks[2], peaks
    assert times[0] < times[1] < times[2], times
    # the recomputation selective AC adds is a small part of what full AC adds (elementwise ops only; full
    # AC's recomputation stops before each block's w2 and residual add: trace/capture.py [Note: Early stop
    # of the recomputation]): 29% here
    assert times[1] - times[0] < 0.33 * (times[2] - times[0]), times


def test_llama8b_torchtitan_policy_recomputes_wk_wo_w3(llama8b, h100):
    """torchtitan's "op" rule numbers a block's matmuls in forward order (wq wk wv wo w1 w3 w2) and
    recomputes the even ones: wk, wo and w3 (37% of the block's matmul FLOPs) beside what keeping every
    matmul recomputes, and stores their outputs no more; its time lies between that policy's and full
    AC's."""
    b, price = 1, flops_price(1)
    every = subtree_selective(llama8b, "layers.0", DEFAULT_SAVE_OPS, b, price)
    alternate = subtree_selective(llama8b, "layers.0", TORCHTITAN_OP_SAVE_OPS, b, price)
    even = [llama8b.module(f"layers.0.{m}") for m in ("attention.wk", "attention.wo", "feed_forward.w3")]
    even_flops = sum(r.flops.at(b) for m in even for r in m.fwd_kernels if r.op_class == "matmul")
    even_bytes = sum(r.new_bytes.at(b) for m in even for r in m.fwd_kernels if r.op_class == "matmul")
    all_mm = sum(r.flops.at(b) for m in llama8b.subtree("layers.0") for r in m.fwd_kernels if r.op_class == "matmul")
    assert every[1] - alternate[1] == pytest.approx(even_flops, rel=1e-9)
    assert every[0] - alternate[0] == pytest.approx(even_bytes, rel=1e-9)
    assert even_flops / all_mm == pytest.approx(0.365, abs=0.005)
    cm = CostModel(llama8b, replace(h100, compute_model="roofline"))
    plans = [_blocks_plan(llama8b, "selective", 32, 8),
             replace(_blocks_plan(llama8b, "selective", 32, 8), units=tuple(
                 replace(u, ac_save_ops=TORCHTITAN_OP_SAVE_OPS) if u.activation_checkpoint else u
                 for u in _blocks_plan(llama8b, "selective", 32, 8).units)),
             _blocks_plan(llama8b, True, 32, 8)]
    times = [cm.time(p).step_time_s for p in plans]
    peaks = [cm.memory(p, timeline=False).peak_bytes for p in plans]
    assert times[0] < times[1] < times[2] and peaks[0] > peaks[1] > peaks[2], (times, peaks)


def test_llama8b_planner_picks_selective_where_it_is_fastest_that_fits(llama8b, h100, monkeypatch):
    """A budget where no AC does not fit and selective AC on every block does: mixing full AC with no AC
    to fit costs a whole forward per checkpointed block, selective only its elementwise ops, so the
    fastest plan that fits checkpoints selectively. The allocated peak decides (allocator_check=False): with
    the caching allocator's retries priced, torchtitan's full AC on every other block (a recipe) survives this
    budget without retries where the selective plans need some, and is the answer then (solve/survive.py)."""
    cm = CostModel(llama8b, h100)
    peaks = {ac: cm.memory(_blocks_plan(llama8b, ac, 32, 8), timeline=False).peak_bytes
             for ac in (False, "selective", True)}
    budget = h100.mem_for_tensor_budget((peaks[False] + peaks["selective"]) // 2)
    result = plan_model(llama8b, PlanRequest(gpus=8, mem_budget_bytes=budget, profile=h100, micro_batch=1,
                                             allocator_check=False))
    modes = Counter(u.activation_checkpoint for u in result.plan.inner_units)
    assert modes["selective"] >= 16, modes
    assert peaks["selective"] <= h100.tensor_budget_bytes(budget) < peaks[False]
    assert result.plan.predicted.peak_bytes <= h100.tensor_budget_bytes(budget)
    full_every_block = cm.estimate(_blocks_plan(llama8b, True, 32, 8), timeline=False)
    assert result.plan.predicted.step_time_s < full_every_block.time.step_time_s
    # the best plan without selective AC (the planner's own, on a space without it) is slower
    assert result.fastest_step_time_s < _fastest_without_selective(llama8b, h100, budget, monkeypatch)


def _fastest_without_selective(trace, profile, budget, monkeypatch):
    """The planner's fastest plan on a search space without selective checkpointing."""
    import shard_planner.solve.polish as polish
    import shard_planner.solve.space as space
    with monkeypatch.context() as m:
        m.setattr(space, "supports_selective", lambda _trace: False)
        m.setattr(polish, "supports_selective", lambda _trace: False)
        request = PlanRequest(gpus=8, mem_budget_bytes=budget, profile=profile, micro_batch=1, allocator_check=False)
        return plan_model(trace, request).fastest_step_time_s


# ---- helpers ----

def _blocks_plan(trace, ac, n_layers: int, gpus: int, micro_batch: int = 1) -> Plan:
    units = [Unit(("",), False)] + [Unit((f"layers.{i}",), True, ac) for i in range(n_layers)]
    return _plan(trace, units, gpus, micro_batch)


def _plan(trace, units, gpus: int = 8, micro_batch: int = 1) -> Plan:
    fp = trace.fingerprint if trace is not None else "x"
    return Plan(ModelRef(LLAMA, fp), Cluster(gpus, 8, "h100-80gb", 80 * GiB), Mesh(gpus), Training(micro_batch),
                tuple(units), Prefetch(0, 1))

