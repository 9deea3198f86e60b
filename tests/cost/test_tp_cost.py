"""Tier 1: tensor-parallel collectives in the cost model (cost/tp_comm.py) on a hand-written one-rank trace
(tests/models/cost_synth.py ``tp_rank``): each adds its ring time to the step on the critical path, is
counted per step with its recomputation, and a plan of another degree than its trace is refused."""

import dataclasses

import pytest

from shard_planner.plan.comm import ALL_GATHER, REDUCE_SCATTER, CollectiveBytes
from shard_planner.cost import CostModel, estimate
from shard_planner.cost.collectives import ring_time_s, tp_collective_time_s
from shard_planner.cost.schedule import build_schedule
from shard_planner.cost.tables import build_tables
from shard_planner.cost.tp_comm import tp_bytes_per_step
from shard_planner.errors import PlanError
from shard_planner.parallel.mesh import Mesh
from shard_planner.hardware.profile import load_profile
from shard_planner.parallel.tensor_parallel import TensorParallel
from tests.cost.test_cost_model import synth_plan
from tests.models.cost_synth import synthetic_trace

LAYERS, H, S, V = 4, 1024, 512, 4096
ACT = S * H * 2  # one (s, h) bf16 activation per sample
STYLES = TensorParallel(styles={"embed": "embedding", "head": "head"}, sequence_parallel=False, loss_parallel=False)


def tp_plan(trace, tp, **kw):
    plan = synth_plan(trace, world=8 // tp, **kw)
    mesh = Mesh(shard=8 // tp, tp=tp)
    return dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, gpus=8), mesh=mesh,
                               tensor_parallel=STYLES if tp > 1 else None)


@pytest.fixture(scope="module")
def h100():
    return load_profile("h100-80gb")


def test_tp_collective_time_is_the_ring_over_the_node(h100):
    ic = h100.interconnect
    one = ring_time_s(ACT, 4, ic.intra_node_latency_s, ic.intra_node_busbw_bytes_per_s, ic.intra_node_busbw_half_bytes)
    assert tp_collective_time_s(h100, ALL_GATHER, ACT, Mesh.tp_group(4)) == pytest.approx(one)
    assert tp_collective_time_s(h100, "all_reduce", ACT, Mesh.tp_group(4)) == pytest.approx(2 * one)
    assert tp_collective_time_s(h100, ALL_GATHER, ACT, Mesh.tp_group(1)) == 0.0


@pytest.mark.parametrize("profile_name", ["h100-80gb", "cpu-gloo"])
@pytest.mark.parametrize("ckpt", [(), (0, 2)])
def test_tp_collectives_add_their_ring_time_on_the_critical_path(profile_name, ckpt):
    """The step with the collectives is the step without them (the same trace, its records dropped) plus
    every collective's ring time, a checkpointed block's forward ones twice; all of it exposed."""
    tp, h100 = 4, load_profile(profile_name)  # a GPU's two streams and a CPU's one thread alike
    trace = synthetic_trace(LAYERS, H, S, V, tp=tp)
    silent = dataclasses.replace(trace, modules=tuple(dataclasses.replace(m, tp_collectives=())
                                                      for m in trace.modules))
    plan = tp_plan(trace, tp, mb=2, ckpt=ckpt)
    with_tp, without = CostModel(trace, h100).time(plan), CostModel(silent, h100).time(plan)
    ranks_see = CostModel(trace, h100).for_world(plan.mesh.world_size).profile  # CPU ranks share the host's cores
    one = tp_collective_time_s(ranks_see, ALL_GATHER, 2 * ACT, plan.mesh)  # AG and RS cost the same
    per_block = 4 * one  # attention and MLP: AG + RS forward each
    blocks_fwd = LAYERS * per_block + 2 * one  # embedding RS, head AG
    expected = blocks_fwd + LAYERS * per_block + len(ckpt) * per_block  # backward, recomputation
    assert with_tp.tp_comm_s == pytest.approx(expected)
    assert with_tp.step_time_s - without.step_time_s == pytest.approx(expected, rel=1e-6)
    assert with_tp.compute_s == pytest.approx(without.compute_s, rel=1e-9)
    assert with_tp.exposed_comm_s - without.exposed_comm_s == pytest.approx(expected, rel=1e-6)


def test_tp_bytes_per_step(h100):
    tp = 2
    trace = synthetic_trace(LAYERS, H, S, V, tp=tp)
    plan = dataclasses.replace(tp_plan(trace, tp, mb=3, ckpt=(1,)),
                               training=dataclasses.replace(tp_plan(trace, tp).training, micro_batch=3,
                                                            accumulation_steps=2))
    t = build_tables(trace, plan.units)
    checkpointed = build_schedule(t, plan.units, plan.prefetch).checkpointed
    got = tp_bytes_per_step(plan, trace, t, checkpointed)
    # per micro-step: 4 blocks x 2 modules x (AG, RS) forward and backward, block 1 recomputes its forward
    ag_calls = 2 * (LAYERS * 2 * 2 + 2 + 1)  # + the head's all-gather; + block 1's two recomputed
    rs_calls = 2 * (LAYERS * 2 * 2 + 2 + 1)  # + the embedding's reduce-scatter
    assert got == (CollectiveBytes(ALL_GATHER, tp, ag_calls, ag_calls * 3 * ACT),
                   CollectiveBytes(REDUCE_SCATTER, tp, rs_calls, rs_calls * 3 * ACT))
    assert tp_bytes_per_step(synth_plan(synthetic_trace(LAYERS, H, S, V), world=8), synthetic_trace(LAYERS, H, S, V),
                             t, checkpointed) == ()


def test_tp_trace_and_plan_must_agree(h100):
    trace = synthetic_trace(LAYERS, H, S, V, tp=2)
    with pytest.raises(PlanError, match="over 1 tensor-parallel ranks but the trace .* at tp 2"):
        estimate(trace, synth_plan(trace, world=8), h100, timeline=False)
    est = estimate(trace, tp_plan(trace, 2), h100, timeline=False)
    full = estimate(synthetic_trace(LAYERS, H, S, V), synth_plan(synthetic_trace(LAYERS, H, S, V), world=8), h100,
                    timeline=False)
    # FSDP over 4 of tp 2's split parameters holds what FSDP over 8 does (replicated norms aside); a
    # unit's gathered parameters are half as large
    at, full_at = est.memory.memory_at_peak, full.memory.memory_at_peak
    assert at["sharded_params"] == pytest.approx(full_at["sharded_params"], rel=1e-4)
    assert at["unsharded_params"] == pytest.approx(full_at["unsharded_params"] / 2, rel=1e-3)
