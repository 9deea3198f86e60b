"""The memory walk's allocation events (cost/allocations.py): every allocation is freed or is state alive
at the end of the step, frees never exceed what a kind holds on a stream, each kind comes from the stream
FSDP2 allocates it on, and the all-gather output is an allocation of its own (it differs from the
unsharded parameters when the all-gather runs in another dtype, as float8 and NF4 all-gathers do)."""

from collections import defaultdict
from dataclasses import replace

import pytest

from shard_planner.cost import CostModel
from shard_planner.cost.accumulation import simulate_accumulated_memory
from shard_planner.cost.allocations import Kind, Stream
from shard_planner.cost.memory import simulate_memory_walk
from shard_planner.cost.queries import BlockQuery, PlanQuery, ScheduleQuery, SelectiveQuery, UnitBytesQuery
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Training, Unit
from shard_planner.hardware.profile import load_profile
from tests.models import solve_traces

# what lives through the whole step: sharded state, the overhead, the batch (the activation level)
STEP_STATE = {Kind.SHARDED_PARAMS, Kind.OPTIMIZER_STATES, Kind.OVERHEAD, Kind.ACTIVATIONS}
# the stream FSDP2 allocates each kind on ([Note: Which stream allocates what]); temporaries and comm
# buffers come from several
STREAM_OF = {Kind.ALL_GATHER_OUTPUT: {Stream.COPY_IN}, Kind.UNSHARDED_PARAMS: {Stream.DEFAULT},
             Kind.SHARDED_PARAMS: {Stream.DEFAULT}, Kind.OPTIMIZER_STATES: {Stream.DEFAULT},
             Kind.ACTIVATIONS: {Stream.DEFAULT}, Kind.OVERHEAD: {Stream.DEFAULT},
             Kind.GRADS: {Stream.DEFAULT, Stream.REDUCE_SCATTER},
             Kind.COMM_BUFFERS: {Stream.DEFAULT, Stream.REDUCE_SCATTER},
             Kind.TEMPORARIES: {Stream.DEFAULT, Stream.COPY_IN, Stream.REDUCE_SCATTER}}


class Recorder:
    """An accountant that keeps every event and the live bytes per (kind, stream)."""

    def __init__(self):
        self.events = []
        self.live = defaultdict(float)
        self.lowest = 0.0  # the lowest live bytes any (kind, stream) reached, relative to its size

    def on_alloc(self, kind, size_bytes, owner, stream):
        assert isinstance(kind, Kind) and isinstance(stream, Stream) and isinstance(owner, str)
        self.events.append(("alloc", kind, size_bytes, owner, stream))
        self.live[kind, stream] += size_bytes

    def on_free(self, kind, size_bytes, owner, stream):
        self.events.append(("free", kind, size_bytes, owner, stream))
        self.live[kind, stream] -= size_bytes
        assert self.live[kind, stream] >= -1e-6 * max(1.0, size_bytes), (kind, stream, owner)

    def on_mark(self, what, who, phase, temp_bytes, comm_bytes, stream):
        """The mark's scratch as allocations before it and frees after it (cost/allocations.py)."""
        scratch = [(k, size) for k, size in ((Kind.TEMPORARIES, temp_bytes), (Kind.COMM_BUFFERS, comm_bytes)) if size]
        for kind, size in scratch:
            self.on_alloc(kind, size, who, stream)
        self.events.append(("mark", what, who, phase))
        for kind, size in reversed(scratch):
            self.on_free(kind, size, who, stream)


def _plan(n=1, sync="every_micro_step", keep=False, reshard=True, ckpt=False, gpus=8, replicate=1):
    trace = solve_traces.stack_trace(4)
    units = (Unit(("",), False), Unit(("embed",), reshard),
             *(Unit((f"layers.{i}",), reshard, ckpt) for i in range(4)), Unit(("head",), reshard))
    plan = Plan(ModelRef(trace.model_path, trace.fingerprint, trace.tokens_per_sample),
                Cluster(gpus, 8, "test", 80 * 2**30), Mesh(gpus // replicate, replicate),
                Training(2, "adamw", "bfloat16", "float32", accumulation_steps=n, gradient_sync=sync,
                         keep_params_gathered=keep), units)
    return trace, plan


def _walk(trace, plan, profile, *, unit_bytes=None):
    """CostModel's memory walk of ``plan`` with a Recorder beside the totals and the timeline."""
    model = CostModel(trace, profile)
    q = PlanQuery.of(plan)
    ub = unit_bytes(model._unit_bytes_of(UnitBytesQuery.of(q))) if unit_bytes else model._unit_bytes_of(
        UnitBytesQuery.of(q))
    walk = simulate_memory_walk if plan.training.accumulation_steps == 1 else simulate_accumulated_memory
    rec = Recorder()
    est = walk(trace, model.tables(q.units), q, profile, ub, model._schedule(ScheduleQuery.of(q)),
               model._block_activations(BlockQuery.of(q)), timeline=True,
               selective=model._selective_blocks(SelectiveQuery.of(q)), accountants=(rec,))
    return est, rec, ub


PLANS = {
    "plain": dict(), "reshard to 2": dict(reshard=2), "no reshard": dict(reshard=False),
    "checkpointed": dict(ckpt=True), "HSDP": dict(replicate=2),
    "accumulate, sync every": dict(n=3), "accumulate, sync last, kept gathered": dict(n=3, sync="last_micro_step",
                                                                                     keep=True),
}


@pytest.mark.parametrize("profile_name", ["cpu-gloo", "h100-80gb"])
@pytest.mark.parametrize("name", list(PLANS))
def test_every_allocation_is_freed_or_step_state(name, profile_name):
    trace, plan = _plan(**PLANS[name])
    est, rec, _ = _walk(trace, plan, load_profile(profile_name))
    assert est == CostModel(trace, load_profile(profile_name)).memory(plan)  # an accountant changes nothing
    for (kind, stream), live in rec.live.items():
        if kind not in STEP_STATE:
            assert live == pytest.approx(0.0, abs=1e-6), (kind, stream)
    for ev in rec.events:
        if ev[0] != "mark":
            assert ev[4] in STREAM_OF[ev[1]], ev
    marks = [ev for ev in rec.events if ev[0] == "mark"]
    assert len(marks) == len(est.timeline)
    allocated = {ev[1] for ev in rec.events if ev[0] == "alloc"}
    assert {Kind.ALL_GATHER_OUTPUT, Kind.UNSHARDED_PARAMS, Kind.GRADS, Kind.COMM_BUFFERS} <= allocated


def test_all_gather_output_is_its_own_allocation():
    """A float8 all-gather of bf16 parameters (synthetic UnitBytes: half the output): the all-gather
    outputs shrink, the unsharded parameters do not, and the comm buffers they are reported in follow."""
    trace, plan = _plan()
    profile = load_profile("cpu-gloo")
    base, base_rec, ub = _walk(trace, plan, profile)
    fp8, rec, ub8 = _walk(trace, plan, profile,
                          unit_bytes=lambda ub: tuple(replace(x, all_gather_output=x.unsharded / 2) for x in ub))

    def sizes(r, kind):
        return [ev[2] for ev in r.events if ev[0] == "alloc" and ev[1] is kind]
    assert sizes(rec, Kind.UNSHARDED_PARAMS) == sizes(base_rec, Kind.UNSHARDED_PARAMS)
    assert sizes(rec, Kind.ALL_GATHER_OUTPUT) == [s / 2 for s in sizes(base_rec, Kind.ALL_GATHER_OUTPUT)]
    assert any(s > 0 for s in sizes(rec, Kind.ALL_GATHER_OUTPUT))
    assert all(x.all_gather_output != x.unsharded for x in ub8 if x.unsharded)
    for a, b in zip(base.timeline, fp8.timeline):
        assert a.bytes_by_category["unsharded_params"] == b.bytes_by_category["unsharded_params"]
        assert b.bytes_by_category["comm_buffers"] <= a.bytes_by_category["comm_buffers"]
    assert any(b.bytes_by_category["comm_buffers"] < a.bytes_by_category["comm_buffers"]
               for a, b in zip(base.timeline, fp8.timeline))
    assert sum(x.all_gather_output for x in ub) == sum(x.unsharded for x in ub)  # today: equal
