"""Tier 1: the cost model on hand-written traces — exact numbers, the ZeRO formula, monotonicity."""

import dataclasses
import itertools

import pytest


from tests.models import cost_mlp  # noqa: E402

from shard_planner.cost import estimate, model_state_bytes, simulate_memory, simulate_time  # noqa: E402
from shard_planner.cost.collectives import (  # noqa: E402
    all_gather_time_s, reduce_scatter_time_s, replica_all_reduce_time_s, ring_time_s,
)
from shard_planner.errors import PlanError  # noqa: E402
from shard_planner.plan import (  # noqa: E402
    MEMORY_CATEGORIES, Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit,
)

D, LAYERS = 128, 4
PSI = (LAYERS + 1) * D * D  # parameters of the MLP: 4 blocks + head, no biases


def mlp_plan(world=2, *, units=None, fwd=0, bwd=1, mb=64, pd="bfloat16", rd="float32", opt="adamw",
             offload=False, ckpt=False, reshard=True, root=False, replicate=1, profile="cpu-gloo"):
    if units is None:
        units = [Unit(("",), root)] + [Unit((f"blocks.{i}",), reshard, ckpt) for i in range(LAYERS)]
    return Plan(model=ModelRef("tests/models/cost_mlp.py", "cost_mlp"),
                cluster=Cluster(world * replicate, 8, profile, 2**30), mesh=Mesh(world, replicate),
                training=Training(mb, opt, pd, rd, offload), units=tuple(units), prefetch=Prefetch(fwd, bwd))


def synth_plan(trace, world=8, *, fwd=0, bwd=1, mb=1, ckpt=(), reshard=True, group=1, profile="h100-80gb",
               replicate=1, offload=False):
    layers = [m.fqn for m in trace.modules if m.type_name == "Block"]
    units = [Unit(("",), False)]
    for i in range(0, len(layers), group):
        units.append(Unit(tuple(layers[i:i + group]), reshard, i in ckpt))
    return Plan(model=ModelRef("synthetic", trace.fingerprint), cluster=Cluster(world * replicate, 8, profile, 80 * 2**30),
                mesh=Mesh(world, replicate), training=Training(mb, cpu_offload=offload), units=tuple(units),
                prefetch=Prefetch(fwd, bwd))


@pytest.fixture(scope="module")
def mlp():
    return cost_mlp.analytic_trace(D, LAYERS)


# ---- model state: ZeRO §5 as FSDP2 realises it ----
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 64, 100, 1024, 4096])
def test_fully_sharded_mixed_precision_adam_is_zero_formula(mlp, n):
    """ZeRO-3 mixed-precision Adam: (2 + 2 + K)Ψ/N with K = 12. FSDP2 realises it as fp32 sharded
    params 4Ψ/N (ZeRO's master copy) + fp32 sharded grads 4Ψ/N (ZeRO's 2Ψ 16-bit params + 2Ψ 16-bit
    grads) + AdamW states 8Ψ/N; see memory.py [Note: FSDP2 model state]."""
    state = model_state_bytes(mlp, mlp_plan(n))
    assert state["sharded_params"] == round(4 * PSI / n)
    assert state["grads"] == round(4 * PSI / n)
    assert state["optimizer_states"] == round(8 * PSI / n)
    assert sum(state.values()) == pytest.approx((2 + 2 + 12) * PSI / n, abs=3)


@pytest.mark.parametrize("opt, k_states", [("adamw", 2), ("adam", 2), ("sgd_momentum", 1), ("sgd", 0)])
@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_model_state_per_optimizer_and_reduce_dtype(mlp, opt, k_states, reduce_dtype):
    """Sharded grads are cast back to the built dtype whatever the reduce dtype (foreach_reduce)."""
    n = 4
    state = model_state_bytes(mlp, mlp_plan(n, opt=opt, rd=reduce_dtype))
    assert state == {"sharded_params": 4 * PSI // n, "grads": 4 * PSI // n, "optimizer_states": 4 * k_states * PSI // n}


def test_model_state_in_the_timeline(mlp, gloo):
    """The simulator's timeline holds exactly that state: params and states always, grads after backward."""
    n = 2
    est = simulate_memory(mlp, mlp_plan(n), gloo)
    end = next(e for e in est.timeline if e.label == "backward: end").bytes_by_category
    assert end["sharded_params"] == 4 * PSI // n
    assert end["optimizer_states"] == 8 * PSI // n
    assert end["grads"] == 4 * PSI // n
    last = est.timeline[-1].bytes_by_category
    assert last["grads"] == 0 and last["unsharded_params"] == 0 and last["comm_buffers"] == 0


# ---- the whole timeline, exactly ----
def test_default_plan_peak_by_hand(mlp, gloo):
    """World size 2, micro-batch 64, bf16 params, fp32 reduce, AdamW, gloo. W = one block's bf16
    unsharded bytes = its fp32 shard = 32 KiB; X = one (64, 128) bf16 activation = 16 KiB.
    The peak is blocks.3's reduce-scatter (measured 966684 B in a real run, 28 B of Adam step scalars
    more; tests/test_cost_realrun.py):
      sharded params 5W + AdamW states 10W
      the root's head: unsharded W + its bf16 gradient W (live through backward)
      blocks.3's last gradient, still held W; reduce-scatter input (fp32) 2W + output W
      blocks.2's prefetched all-gather output W; gloo's copy of the input 2W
      activations: batch (x, y fp32) 4X + 6 saved + the input gradient X = 11X"""
    W, X = 32768, 16384
    est = simulate_memory(mlp, mlp_plan(2), gloo)
    assert est.peak_event == "backward: reduce-scatter blocks.3"
    assert est.peak_bytes == 24 * W + 11 * X == 966656
    assert est.memory_at_peak == {
        "sharded_params": 5 * W, "unsharded_params": W, "grads": 2 * W, "optimizer_states": 10 * W,
        "activations": 11 * X, "temporaries": 2 * W, "comm_buffers": 4 * W, "overhead": 0,
    }
    assert est.peak_bytes == max(e.total_bytes for e in est.timeline)
    assert all(set(e.bytes_by_category) == set(MEMORY_CATEGORIES) for e in est.timeline)


def test_forward_all_gather_buffers_by_hand(mlp, gloo):
    """[Note: All-gather buffers]: at blocks.0's copy-out the root's flat output, blocks.0's flat output
    and blocks.0's parameters are live; while blocks.0 computes, its own flat output still is."""
    W = 32768
    tl = {e.label: e.bytes_by_category for e in simulate_memory(mlp, mlp_plan(2), gloo).timeline}
    assert tl["forward: copy-out blocks.0"]["comm_buffers"] == 2 * W
    assert tl["forward: copy-out blocks.0"]["unsharded_params"] == 2 * W  # root's head + blocks.0
    assert tl["forward: blocks.0"]["comm_buffers"] == W
    assert tl["forward: end"]["comm_buffers"] == 0


def test_int_reshard_keeps_one_rth(mlp, h100):
    """reshard_after_forward=2 on 8 ranks keeps 1/2 of each block's bf16 parameters after forward, and
    costs one more process group. See [Note: Reshard to a smaller group]."""
    W = D * D * 2
    plan = mlp_plan(8, reshard=2, profile="h100-80gb")
    est = simulate_memory(mlp, plan, h100)
    end = next(e for e in est.timeline if e.label == "forward: end").bytes_by_category
    assert end["unsharded_params"] == W + LAYERS * W // 2  # the root's head + 4 half blocks
    assert end["overhead"] == h100.reserved_bytes + h100.per_process_group_bytes
    true_end = next(e for e in simulate_memory(mlp, mlp_plan(8, profile="h100-80gb"), h100).timeline
                    if e.label == "forward: end").bytes_by_category
    assert true_end["unsharded_params"] == W and true_end["overhead"] == h100.reserved_bytes


def test_reshard_false_keeps_units_until_backward(mlp, gloo):
    W = 32768
    est = simulate_memory(mlp, mlp_plan(2, reshard=False), gloo)
    end = next(e for e in est.timeline if e.label == "forward: end").bytes_by_category
    assert end["unsharded_params"] == (LAYERS + 1) * W


def test_cpu_offload_leaves_a_gpu_but_not_a_cpu(mlp, gloo, h100):
    on_gpu = simulate_memory(mlp, mlp_plan(2, offload=True, profile="h100-80gb"), h100)
    assert all(e.bytes_by_category["sharded_params"] == 0 and e.bytes_by_category["optimizer_states"] == 0
               for e in on_gpu.timeline)
    plain = simulate_memory(mlp, mlp_plan(2, profile="h100-80gb"), h100)
    assert on_gpu.peak_bytes < plain.peak_bytes
    on_cpu = simulate_memory(mlp, mlp_plan(2, offload=True), gloo)
    assert on_cpu.peak_bytes == simulate_memory(mlp, mlp_plan(2), gloo).peak_bytes


def test_unknown_module_is_a_plan_error(mlp, gloo):
    plan = mlp_plan(2, units=[Unit(("",)), Unit(("blocks.9",))])
    with pytest.raises(PlanError, match="blocks.9"):
        simulate_memory(mlp, plan, gloo)


# ---- monotonicity ----
@pytest.mark.parametrize("opt", ["adamw", "sgd_momentum", "sgd"])
def test_more_ranks_never_raise_sharded_state(mlp, synth, opt):
    for trace in (mlp, synth):
        previous = None
        for n in range(1, 65):
            plan = mlp_plan(n, opt=opt) if trace is mlp else dataclasses.replace(
                synth_plan(trace, n), training=Training(1, opt))
            state = sum(model_state_bytes(trace, plan).values())
            if previous is not None:
                assert state <= previous, (n, state, previous)
            previous = state


def test_more_ranks_never_raise_sharded_state_at_the_peak(synth, h100):
    previous = None
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        at_peak = estimate(synth, synth_plan(synth, n), h100, timeline=False).memory.memory_at_peak
        sharded = at_peak["sharded_params"] + at_peak["optimizer_states"]
        if previous is not None:
            assert sharded <= previous
        previous = sharded


@pytest.mark.parametrize("trace_name", ["mlp", "synth"])
@pytest.mark.parametrize("reshard", [True, False])
def test_deeper_prefetch_never_lowers_peak(request, trace_name, reshard, gloo, h100):
    trace = request.getfixturevalue(trace_name)
    for mb in (1, 8, 64):
        for bwd in (1, 2, 3):
            peaks = []
            for fwd in range(0, 5):
                plan = (mlp_plan(4, fwd=fwd, bwd=bwd, mb=mb, reshard=reshard) if trace_name == "mlp"
                        else synth_plan(trace, 8, fwd=fwd, bwd=bwd, mb=mb, reshard=reshard))
                peaks.append(simulate_memory(trace, plan, gloo if trace_name == "mlp" else h100).peak_bytes)
            assert peaks == sorted(peaks), (mb, bwd, peaks)
        for fwd in (0, 2):
            peaks = []
            for bwd in range(1, 5):
                plan = (mlp_plan(4, fwd=fwd, bwd=bwd, mb=mb, reshard=reshard) if trace_name == "mlp"
                        else synth_plan(trace, 8, fwd=fwd, bwd=bwd, mb=mb, reshard=reshard))
                peaks.append(simulate_memory(trace, plan, gloo if trace_name == "mlp" else h100).peak_bytes)
            assert peaks == sorted(peaks), (mb, fwd, peaks)


def _max_activations(est):
    return max(e.bytes_by_category["activations"] for e in est.timeline)


def test_checkpointing_never_raises_activations(mlp, synth, gloo, h100):
    for mb in (1, 16, 512):
        for subset in itertools.chain.from_iterable(itertools.combinations(range(LAYERS), k) for k in range(LAYERS + 1)):
            units = [Unit(("",))] + [Unit((f"blocks.{i}",), True, i in subset) for i in range(LAYERS)]
            base = _max_activations(simulate_memory(mlp, mlp_plan(2, mb=mb), gloo))
            ck = _max_activations(simulate_memory(mlp, mlp_plan(2, mb=mb, units=units), gloo))
            assert ck <= base, (mb, subset)
    layers = range(8)
    for k in range(9):
        plan = synth_plan(synth, 8, mb=2, ckpt=set(layers[:k]))
        act = _max_activations(simulate_memory(synth, plan, h100))
        if k:
            assert act <= previous
        previous = act
    # and checkpointing everything keeps about one layer input per layer (Korthikanti et al. 2022 §4.2)
    full = _max_activations(simulate_memory(synth, synth_plan(synth, 8, mb=1, ckpt=set(layers)), h100))
    none = _max_activations(simulate_memory(synth, synth_plan(synth, 8, mb=1), h100))
    assert full < none / 5


# ---- time ----
def test_ring_formula():
    # 8 ranks, 1 GB, 10 us per step, 100 GB/s busbw: 7 * 10 us + 7/8 * 10 ms
    assert ring_time_s(1e9, 8, 1e-5, 1e11) == pytest.approx(7e-5 + 0.875e-2)
    assert ring_time_s(1e9, 1, 1e-5, 1e11) == 0.0


def test_inter_node_and_hsdp_cost_more(h100):
    nbytes = 2e9
    assert all_gather_time_s(h100, nbytes, Mesh(16)) > all_gather_time_s(h100, nbytes, Mesh(8))
    # HSDP: reduce-scatter in the shard group, then an all-reduce of 1/shard across replicas
    plain = reduce_scatter_time_s(h100, nbytes, Mesh(8))
    hsdp = reduce_scatter_time_s(h100, nbytes, Mesh(8, replicate=4)) + replica_all_reduce_time_s(
        h100, nbytes, Mesh(8, replicate=4))
    ic = h100.interconnect
    assert hsdp - plain == pytest.approx(2 * ring_time_s(nbytes / 8, 4, ic.inter_node_latency_s, ic.inter_node_busbw_bytes_per_s))


def test_cpu_profile_is_serial(mlp, gloo):
    t = simulate_time(mlp, mlp_plan(2), gloo)
    assert t.step_time_s == pytest.approx(t.compute_s + t.comm_s + t.optimizer_s)
    assert t.exposed_comm_s == pytest.approx(t.comm_s)


def test_gpu_overlap_is_bounded(synth, h100):
    for fwd, bwd, reshard in itertools.product((0, 1, 2), (1, 2), (True, False, 4)):
        t = simulate_time(synth, synth_plan(synth, 8, fwd=fwd, bwd=bwd, reshard=reshard, mb=2), h100)
        assert t.step_time_s >= t.compute_s + t.optimizer_s - 1e-12
        assert t.step_time_s >= t.comm_s
        assert t.step_time_s <= t.compute_s + t.comm_s + t.optimizer_s + 1e-12
        assert t.exposed_comm_s == pytest.approx(t.step_time_s - t.compute_s - t.optimizer_s, abs=1e-12)
        assert sum(u.exposed_comm_s for u in t.units) == pytest.approx(t.exposed_comm_s, rel=1e-6, abs=1e-9)


def test_checkpointing_adds_a_forward_to_backward(synth, h100):
    # FSDP2's hooks do not run again in the recomputation: without them the whole forward is added
    h100 = dataclasses.replace(h100, per_unit_overhead_s=0.0)
    base = simulate_time(synth, synth_plan(synth, 8), h100)
    ck = simulate_time(synth, synth_plan(synth, 8, ckpt={0, 1}), h100)
    fwd = [u.fwd_compute_s for u in base.units]
    assert ck.units[1].bwd_compute_s == pytest.approx(base.units[1].bwd_compute_s + fwd[1])
    assert ck.compute_s == pytest.approx(base.compute_s + fwd[1] + fwd[2])


def test_throughput_and_mfu(synth, h100):
    plan = synth_plan(synth, 8, mb=2)
    t = simulate_time(synth, plan, h100)
    assert t.samples_per_s == pytest.approx(2 * 8 / t.step_time_s)
    assert t.tokens_per_s == pytest.approx(t.samples_per_s * synth.tokens_per_sample)
    assert 0 < t.mfu <= h100.compute_efficiency + 1e-9


def test_slower_links_never_speed_up(synth, h100):
    plan = synth_plan(synth, 16, mb=1)
    slow = dataclasses.replace(h100, interconnect=dataclasses.replace(
        h100.interconnect, inter_node_busbw_bytes_per_s=h100.interconnect.inter_node_busbw_bytes_per_s / 10))
    assert simulate_time(synth, plan, slow).step_time_s > simulate_time(synth, plan, h100).step_time_s


def test_estimate_gives_the_plans_prediction(synth, h100):
    est = estimate(synth, synth_plan(synth, 8), h100)
    pred = est.prediction()
    assert pred.peak_bytes == est.memory.peak_bytes == sum(pred.memory_at_peak.values())
    assert set(pred.memory_at_peak) == set(MEMORY_CATEGORIES)
    assert pred.step_time_s == est.time.step_time_s
    fast = estimate(synth, synth_plan(synth, 8), h100, timeline=False)
    assert fast.memory.peak_bytes == est.memory.peak_bytes and fast.memory.timeline == ()


def test_buffers_are_replicated_not_sharded(mlp, gloo):
    """FSDP2 shards parameters only: a 1000-byte buffer costs 1000 bytes on every rank at any N."""
    m = mlp.modules[2]
    with_buffer = dataclasses.replace(mlp, modules=(*mlp.modules[:2], dataclasses.replace(m, buffer_bytes=1000),
                                                    *mlp.modules[3:]))
    for n in (2, 4):
        a = simulate_memory(mlp, mlp_plan(n), gloo).memory_at_peak["sharded_params"]
        b = simulate_memory(with_buffer, mlp_plan(n), gloo).memory_at_peak["sharded_params"]
        assert b - a == 1000


def test_optimizer_step_temporaries(mlp, gloo, h100):
    """[Note: Optimizer step]: GPU foreach AdamW holds one temporary of all sharded params; CPU's
    single-tensor AdamW holds 3x the largest parameter shard; SGD none."""
    def step_temp(plan, profile):
        return next(e for e in simulate_memory(mlp, plan, profile).timeline
                    if e.label == "optimizer step").bytes_by_category["temporaries"]

    assert step_temp(mlp_plan(2), gloo) == 3 * D * D * 4 // 2
    assert step_temp(mlp_plan(8, profile="h100-80gb"), h100) == 4 * PSI // 8
    assert step_temp(mlp_plan(2, opt="sgd_momentum"), gloo) == 0


def test_cpu_adamw_temporaries_as_measured():
    """The constant behind OPTIMIZER_TEMPORARIES_SINGLE_TENSOR, measured with the storage tracker."""
    import torch

    from shard_planner.cost.optimizer import OPTIMIZER_TEMPORARIES_SINGLE_TENSOR
    from shard_planner.execute.memtrack import StorageTracker

    params = [torch.nn.Parameter(torch.randn(128, 128)) for _ in range(4)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # states exist from here on
    tracker = StorageTracker(track=(params, opt))
    with tracker:
        base = tracker.live_bytes
        opt.step()
    assert tracker.peak_bytes - base == OPTIMIZER_TEMPORARIES_SINGLE_TENSOR["adamw"] * 128 * 128 * 4


# ---- framework overhead: per aten op, per FSDP unit, per optimizer tensor ----
def _with_ops(trace, fwd_ops=2, bwd_ops=3, loss_ops=4):
    """Every module that runs dispatches fwd_ops / bwd_ops aten ops; every module with parameters holds
    one parameter tensor (the MLP's Linears have no bias)."""
    modules = tuple(dataclasses.replace(m, fwd_ops_self=fwd_ops if m.calls else 0, bwd_ops_self=bwd_ops if m.calls else 0,
                                        param_tensors=1 if m.param_count else 0) for m in trace.modules)
    return dataclasses.replace(trace, modules=modules, loss_ops=loss_ops)


def _round_overheads(profile, **kw):
    return dataclasses.replace(profile, per_op_overhead_s=1e-5, per_unit_overhead_s=1e-3,
                               per_param_tensor_optimizer_overhead_s=1e-4, **kw)


@pytest.mark.parametrize("ckpt", [False, True])
def test_cpu_step_time_with_overheads_by_hand(mlp, gloo, ckpt):
    trace = _with_ops(mlp)
    prof = _round_overheads(gloo, peak_flops_per_s={"bfloat16": 1e9, "float32": 1e9}, compute_efficiency=1.0,
                            memory_bandwidth_bytes_per_s=1e9)
    t = simulate_time(trace, mlp_plan(1, ckpt=ckpt), prof)  # one rank: no collectives
    # 14 modules run (root, blocks.i, blocks.i.fc, blocks.i.act, head; the ModuleList "blocks" never
    # runs): 28 forward ops, 42 backward ops, 4 loss ops at 10 us. FLOPs at micro-batch 64, 1 GFLOP/s:
    # 5 Linears x 2 x 128^2 x 64 forward = 10,485,760; backward twice that; the loss 384 x 64 = 24,576.
    # 5 units (the root and 4 blocks) x 1 ms of hooks.
    compute = (10_485_760 + 20_971_520 + 24_576) / 1e9 + (28 + 42 + 4) * 1e-5 + 5 * 1e-3
    if ckpt:
        # each block's forward again: 2 x 128^2 x 64 FLOPs, 3 modules x 2 ops; FSDP2's hooks do not run again
        compute += 4 * (2_097_152 / 1e9 + 6 * 1e-5)
    # AdamW: 20 accesses x 81,920 fp32 elements x 4 bytes at 1 GB/s, plus 5 tensors x 100 us
    optimizer = 20 * 81_920 * 4 / 1e9 + 5 * 1e-4
    assert t.compute_s == pytest.approx(compute, rel=1e-12)
    assert t.optimizer_s == pytest.approx(optimizer, rel=1e-12)
    assert t.comm_s == 0
    assert t.step_time_s == pytest.approx(compute + optimizer, rel=1e-12)


def test_gpu_overhead_is_hidden_behind_big_kernels_and_bounds_small_ones(mlp, h100):
    trace = _with_ops(mlp)
    fast = simulate_time(trace, mlp_plan(1, profile="h100-80gb"), _round_overheads(h100))
    # the MLP's kernels take nanoseconds on an H100: every block and the loss take their host time.
    # Blocks: blocks.0-3 (3 modules each: 6 forward, 9 backward ops, 1 ms of hooks per unit), head (2 / 3
    # ops), the root's own ops (2 / 3) with the root unit's hooks (1 ms).
    compute = 4 * ((6 + 9) * 1e-5 + 1e-3) + (2 + 3) * 1e-5 + (2 + 3) * 1e-5 + 1e-3 + 4 * 1e-5
    assert fast.compute_s == pytest.approx(compute, rel=1e-9)
    assert fast.optimizer_s == pytest.approx(20 * 81_920 * 4 / h100.memory_bandwidth_bytes_per_s + 5 * 1e-4)
    # slow kernels (1 kFLOP/s): the host's overhead is hidden behind every block with FLOPs; the root's
    # own operations have none, so its ops (2 + 3) and the root unit's backward hooks (half of 1 ms,
    # issued at the last block, the root's own) still show
    slow = dataclasses.replace(h100, peak_flops_per_s={"bfloat16": 1e3, "float32": 1e3}, compute_efficiency=1.0)
    hidden = simulate_time(trace, mlp_plan(1, profile="h100-80gb"), _round_overheads(slow))
    flops = 10_485_760 + 20_971_520 + 24_576
    assert hidden.compute_s == pytest.approx(flops / 1e3 + (2 + 3) * 1e-5 + 0.5e-3, rel=1e-12)


def test_overheads_grow_with_units_ops_and_tensors(mlp, gloo):
    trace = _with_ops(mlp)
    prof = _round_overheads(gloo)
    many = simulate_time(trace, mlp_plan(2), prof)
    one = simulate_time(trace, mlp_plan(2, units=[Unit(("",), False)]), prof)
    assert many.compute_s - one.compute_s == pytest.approx(4 * 1e-3, rel=1e-9)  # 4 more units' hooks
    more_ops = simulate_time(_with_ops(mlp, fwd_ops=3), mlp_plan(2), prof)
    assert more_ops.compute_s - many.compute_s == pytest.approx(14 * 1e-5, rel=1e-9)
    # a trace without op counts (written before they existed) and a profile without overheads agree
    bare = dataclasses.replace(gloo, per_op_overhead_s=0.0, per_unit_overhead_s=0.0,
                               per_param_tensor_optimizer_overhead_s=0.0)
    assert simulate_time(trace, mlp_plan(2), bare).step_time_s == pytest.approx(
        simulate_time(mlp, mlp_plan(2), bare).step_time_s, rel=1e-12)
