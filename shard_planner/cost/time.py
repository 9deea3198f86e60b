"""Step time of one FSDP2 training step: compute from traced FLOPs, collectives from the ring model,
and a two-stream simulation of their overlap.

Compute: each block's traced forward and backward FLOPs at ``profile.flops_per_s(param dtype)`` (peak
x efficiency); a checkpointed block runs its forward again before its backward; the loss's FLOPs run
between forward and backward.

Communication (shard_planner/cost/collectives.py): per unit, an all-gather of its unsharded bytes in
the param dtype before its forward, another before its backward when it resharded after forward (over
r ranks for ``reshard_after_forward=r``), and a reduce-scatter of its gradients in the reduce dtype
after its backward (plus the replica all-reduce under HSDP). Under CPU offload every all-gather first
copies the fp32 shard host-to-device and every reduce-scatter copies the sharded gradient back.

Overlap (GPU): one compute stream and one communication stream, FIFO in the order the CPU issues
work, with FSDP2's dependencies:

- a unit computes only once its all-gather has finished;
- forward: the all-gather of the k-th next unit is issued when the current unit starts
  (``set_modules_to_forward_prefetch``, depth k); FSDP2's implicit prefetch — the CPU runs ahead and
  issues the next unit's all-gather while the current one computes — gives an effective depth of 1
  when k is 0;
- backward: the root prefetches one unit (FSDP2's default); each unit prefetches the next
  max(1, k) in backward order;
- a reduce-scatter starts after its unit's backward; the optimizer step after the last one.

On a CPU profile (gloo, synchronous collectives on the one thread that also computes) nothing
overlaps: the step is the sum of compute, communication and the optimizer.

Framework overhead (the profile's ``per_op_overhead_s``, ``per_unit_overhead_s``,
``per_param_tensor_optimizer_overhead_s``; measured by ``shard-planner calibrate``, see
shard_planner/execute/calibrate.py). Each block has a *host* time: its traced aten ops
(``fwd_ops_self`` / ``bwd_ops_self`` summed over the block) x per-op overhead, plus half the per-unit
overhead of every unit whose pre-forward runs at the block (FSDP2's pre/post-forward hooks and
all-gather copy-out) and, in backward, the other half at the block where the unit's backward starts
(pre/post-backward hooks, reduce-scatter copies). The loss adds its ops. On a CPU profile the host is
the device: a block takes FLOPs / throughput + host time. On a GPU the host launches asynchronously and
runs ahead, so a block takes max(FLOPs / throughput, host time): the overhead shows only where the
kernels are too small to hide it (small models, small micro-batches). A checkpointed block's
recomputation runs its forward ops again but not FSDP2's hooks (its pre-forward returns at once during
backward: torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _pre_forward). The optimizer step adds per-tensor
overhead x the model's parameter tensors (each rank steps every tensor, sharded). Traces written
before op counts (all zero) get no overhead.

Measured module times (``profile.module_timings``, from ``shard-planner calibrate --model``; see
shard_planner/timings.py and shard_planner/execute/module_timing.py): a block whose module was timed on
the device takes its measured forward and backward at the plan's micro-batch instead of FLOPs /
throughput + ops x per-op overhead — the measurement holds both (a module block: its subtree's time; a
container's ``:self`` block: the container less its nearest timed descendants). A checkpointed block
recomputes with its measured forward; the loss takes its measured forward + backward. FSDP2's per-unit
overhead, the collectives and the optimizer stay as above; blocks the timings lack fall back to FLOPs.
The timings must be for the trace's model (structure fingerprint) and the plan's param dtype, else one
ProfileError line. Per-block measured times are computed once per (tables, timings)
(``measured_block_times``).

The optimizer step is bound by memory bandwidth: bytes touched per sharded element by the foreach
implementation (OPTIMIZER_BYTES_PER_ELEMENT) / ``memory_bandwidth_bytes_per_s`` (the host's under CPU
offload, where the step runs on the host), plus its per-tensor overhead (below).
"""

from __future__ import annotations

import logging

from shard_planner.cost.collectives import all_gather_time_s, reduce_scatter_time_s
from shard_planner.cost.memory import UnitBytes, unit_bytes
from shard_planner.cost.tables import CostTables, cost_tables, dtype_bytes
from shard_planner.cost.types import TimeEstimate, UnitTime
from shard_planner.plan import Plan
from shard_planner.profile import HardwareProfile
from shard_planner.timings import ModuleTime, ModuleTimings
from shard_planner.trace.types import ModelTrace

logger = logging.getLogger(__name__)

# Reads + writes per sharded parameter element of one foreach step, in state-dtype elements.
# torch/optim/adamw.py _multi_tensor_adamw: mul_(params) 2, lerp_(exp_avgs, grads) 3, mul_(exp_avg_sqs)
# 2, addcmul_(exp_avg_sqs, grads, grads) 3, sqrt(exp_avg_sqs) 2, div_ 2, add_(eps) 2,
# addcdiv_(params, exp_avgs, denom) 4 = 20; Adam without weight decay skips the first: 18.
# torch/optim/sgd.py _multi_tensor_sgd: momentum mul_ 2 + add_ 3, then add_(params, bufs) 3 = 8;
# plain SGD: add_(params, grads) 3.
OPTIMIZER_ACCESSES_PER_ELEMENT = {"adamw": 20, "adam": 18, "sgd_momentum": 8, "sgd": 3}


_MEASURED: dict[tuple[int, int], tuple[CostTables, ModuleTimings, tuple]] = {}
_MEASURED_MAX = 256


def measured_block_times(trace: ModelTrace, t: CostTables, timings: ModuleTimings) -> tuple[ModuleTime | None, ...]:
    """Per block of ``t``, its measured time: a module block's subtree time, a ``<fqn>:self`` block's
    container time less its nearest timed descendants' (``ModuleTimings.self_time``); None where the
    timings lack the module (priced from FLOPs). Cached per (tables, timings): the solver evaluates
    thousands of plans over the same segmentations."""
    key = (id(t), id(timings))
    hit = _MEASURED.get(key)
    if hit is not None and hit[0] is t and hit[1] is timings:
        return hit[2]
    children = {m.fqn: m.children for m in trace.modules}
    out = []
    for blk in t.blocks:
        if blk.fqn.endswith(":self"):
            out.append(timings.self_time(blk.fqn[: -len(":self")], children))
        else:
            out.append(timings.modules.get(blk.fqn))
    if len(_MEASURED) >= _MEASURED_MAX:
        _MEASURED.pop(next(iter(_MEASURED)))
    _MEASURED[key] = (t, timings, tuple(out))  # both kept alive with their key: ids are not reused
    return _MEASURED[key][2]


def module_compute_s(trace: ModelTrace, fqn: str | None, micro_batch: int, profile: HardwareProfile,
                     param_dtype: str) -> tuple[float, float]:
    """Forward and backward seconds of ``fqn``'s subtree at ``micro_batch``, compute only (no FSDP2 or
    per-op overhead): measured when ``profile.module_timings`` has the module, else FLOPs / throughput.
    For models of the step time outside the simulator (the solver's linear model); the loss is
    ``fqn=None``."""
    timings = profile.module_timings
    if timings is not None:
        timings.check(trace.fingerprint, param_dtype, f"the trace of {trace.model_path}")
        if fqn is None:
            return timings.loss_fwd_s.at(micro_batch), timings.loss_bwd_s.at(micro_batch)
        m = timings.modules.get(fqn)
        if m is not None:
            return m.fwd_s.at(micro_batch), m.bwd_s.at(micro_batch)
    rate = profile.flops_per_s(param_dtype)
    if fqn is None:  # the trace does not split the loss's FLOPs into forward and backward
        return trace.loss_flops.at(micro_batch) / rate, 0.0
    return (trace.subtree_sum(fqn, "fwd_flops_self").at(micro_batch) / rate,
            trace.subtree_sum(fqn, "bwd_flops_self").at(micro_batch) / rate)


def simulate_time(trace: ModelTrace, plan: Plan, profile: HardwareProfile, *,
                  ub: list[UnitBytes] | None = None) -> TimeEstimate:
    """Predicted time of one training step on one rank, and what it is made of (module docstring).
    ``ub``: ``unit_bytes(cost_tables(trace, plan.units), plan)`` when the caller has it already."""
    t = cost_tables(trace, plan.units)
    if ub is None:
        ub = unit_bytes(t, plan)
    training = plan.training
    b = training.micro_batch
    n = plan.mesh.shard
    n_units = len(plan.units)
    root = next(i for i, u in enumerate(plan.units) if u.is_root)
    rate = profile.flops_per_s(training.param_dtype)
    offload = training.cpu_offload
    h2d = profile.host_to_device_bytes_per_s

    # ---- per-unit collective times ----
    ag_fwd = [0.0] * n_units
    ag_bwd = [0.0] * n_units
    rs = [0.0] * n_units
    for u, (unit, x) in enumerate(zip(plan.units, ub)):
        copy_in = x.sharded / h2d if offload else 0.0
        ag_fwd[u] = all_gather_time_s(profile, x.unsharded, n) + copy_in
        r = unit.reshard_after_forward
        if r is True:
            ag_bwd[u] = ag_fwd[u]
        elif r is not False:
            ag_bwd[u] = all_gather_time_s(profile, x.unsharded, r)
        rs[u] = reduce_scatter_time_s(profile, x.rs_input, n, plan.mesh.replicate)
        if offload:
            rs[u] += x.sharded_grad / h2d
    # the root never reshards unless the plan says so
    needs_bwd_ag = [plan.units[u].reshard_after_forward is not False for u in range(n_units)]

    blocks = t.blocks
    n_blocks = len(blocks)
    op_s = profile.per_op_overhead_s
    half_unit_s = profile.per_unit_overhead_s / 2
    timings = profile.module_timings
    if timings is not None:
        timings.check(trace.fingerprint, training.param_dtype, f"the trace of {trace.model_path}")
        measured = measured_block_times(trace, t, timings)
    else:
        measured = (None,) * len(blocks)
    # A measured block's time already holds its kernels and its per-op framework time: no op overhead.
    ops_fwd = [0.0 if m is not None else blk.fwd_ops * op_s for blk, m in zip(blocks, measured)]
    host_fwd = list(ops_fwd)
    host_bwd = [0.0 if m is not None else blk.bwd_ops * op_s for blk, m in zip(blocks, measured)]
    if half_unit_s:
        for u in t.forward_units:  # units that run: their hooks fire once per step each way
            host_fwd[t.unit_first_block[u]] += half_unit_s
            host_bwd[t.unit_last_block[u]] += half_unit_s
    dev_fwd = [m.fwd_s.at(b) if m is not None else blk.fwd_flops.at(b) / rate for blk, m in zip(blocks, measured)]
    dev_bwd = [m.bwd_s.at(b) if m is not None else blk.bwd_flops.at(b) / rate for blk, m in zip(blocks, measured)]
    if timings is not None:
        loss_dev, loss_host = timings.loss_fwd_s.at(b) + timings.loss_bwd_s.at(b), 0.0
    else:
        loss_dev, loss_host = trace.loss_flops.at(b) / rate, trace.loss_ops * op_s
    ckpt = [plan.units[blk.unit].activation_checkpoint and blk.unit_module for blk in blocks]
    if profile.device == "cpu":  # the host computes: overhead adds up
        rec_s = [dev_fwd[i] + ops_fwd[i] if ckpt[i] else 0.0 for i in range(n_blocks)]
        fwd_s = [dev_fwd[i] + host_fwd[i] for i in range(n_blocks)]
        bwd_s = [dev_bwd[i] + host_bwd[i] for i in range(n_blocks)]
        loss_s = loss_dev + loss_host
    else:  # asynchronous launch: the slower of the GPU's work and the host's issuing it
        rec_s = [max(dev_fwd[i], ops_fwd[i]) if ckpt[i] else 0.0 for i in range(n_blocks)]
        fwd_s = [max(dev_fwd[i], host_fwd[i]) for i in range(n_blocks)]
        bwd_s = [max(dev_bwd[i], host_bwd[i]) for i in range(n_blocks)]
        loss_s = max(loss_dev, loss_host)

    unit_fwd = [0.0] * n_units
    unit_bwd = [0.0] * n_units
    for i, blk in enumerate(blocks):
        unit_fwd[blk.unit] += fwd_s[i]
        unit_bwd[blk.unit] += bwd_s[i] + rec_s[i]
    compute_s = sum(unit_fwd) + sum(unit_bwd) + loss_s

    # ---- optimizer ----
    sharded_elems = sum(t.unit_float_numel) / n
    state_bytes = dtype_bytes(t.built_dtype)
    opt_bytes = OPTIMIZER_ACCESSES_PER_ELEMENT[training.optimizer] * sharded_elems * state_bytes
    bw = (profile.host_memory_bandwidth_bytes_per_s or profile.memory_bandwidth_bytes_per_s) if offload \
        else profile.memory_bandwidth_bytes_per_s
    optimizer_s = opt_bytes / bw + t.param_tensors * profile.per_param_tensor_optimizer_overhead_s

    comm_s = sum(ag_fwd) + sum(ag_bwd[u] for u in range(n_units) if needs_bwd_ag[u]) + sum(rs)
    exposed = [0.0] * n_units

    if profile.device == "cpu":
        # gloo collectives are synchronous on the thread that computes: nothing overlaps.
        for u in range(n_units):
            exposed[u] = ag_fwd[u] + (ag_bwd[u] if needs_bwd_ag[u] else 0.0) + rs[u]
        step_s = compute_s + comm_s + optimizer_s
    else:
        step_s = _overlap(t, plan, root, blocks, fwd_s, bwd_s, rec_s, loss_s, ag_fwd, ag_bwd, rs,
                          needs_bwd_ag, exposed) + optimizer_s

    samples = b * plan.mesh.world_size
    model_flops = (t.model_fwd_flops.at(b) + t.model_bwd_flops.at(b) + trace.loss_flops.at(b))
    peak = profile.peak_flops_per_s.get(training.param_dtype) or rate
    units = tuple(
        UnitTime(name=plan.units[u].name, fwd_compute_s=unit_fwd[u], bwd_compute_s=unit_bwd[u],
                 all_gather_s=ag_fwd[u] + (ag_bwd[u] if needs_bwd_ag[u] else 0.0),
                 reduce_scatter_s=rs[u], exposed_comm_s=exposed[u])
        for u in range(n_units)
    )
    return TimeEstimate(
        step_time_s=step_s,
        compute_s=compute_s,
        comm_s=comm_s,
        exposed_comm_s=max(0.0, step_s - compute_s - optimizer_s),
        optimizer_s=optimizer_s,
        samples_per_s=samples / step_s if step_s > 0 else 0.0,
        tokens_per_s=samples * trace.tokens_per_sample / step_s if trace.tokens_per_sample and step_s > 0 else None,
        mfu=model_flops / (step_s * peak) if step_s > 0 else 0.0,
        units=units,
    )


def _overlap(t, plan, root, blocks, fwd_s, bwd_s, rec_s, loss_s, ag_fwd, ag_bwd, rs, needs_bwd_ag,
             exposed) -> float:
    """Two streams, FIFO communication; returns the time the last reduce-scatter and the last compute
    have both finished. ``exposed[u]`` accumulates the compute stream's wait for unit u's all-gather."""
    comp = 0.0  # compute stream: free from this time on
    comm = 0.0  # communication stream
    fwd_units = t.forward_units
    d_fwd = max(1, plan.prefetch.forward)
    d_bwd = max(1, plan.prefetch.backward)
    n_units = len(plan.units)

    # ---- forward ----
    ag_end = [-1.0] * n_units
    start = [0.0] * n_units  # compute start of each unit (its pre-forward)
    pos = {u: i for i, u in enumerate(fwd_units)}
    issued = 0  # fwd_units[:issued] have their all-gather issued

    def issue_forward_until(j: int) -> None:
        nonlocal comm, issued
        while issued <= min(j, len(fwd_units) - 1):
            u = fwd_units[issued]
            k = issued - d_fwd  # the unit whose pre-forward issues this all-gather
            ready = start[fwd_units[k]] if k >= 0 else 0.0
            begin = max(comm, ready)
            comm = begin + ag_fwd[u]
            ag_end[u] = comm
            issued += 1

    def enter(u: int) -> None:
        nonlocal comp
        i = pos[u]
        issue_forward_until(i)
        wait = max(0.0, ag_end[u] - comp)
        exposed[u] += wait
        comp += wait
        start[u] = comp
        issue_forward_until(i + d_fwd)

    enter(root)
    for i, blk in enumerate(blocks):
        for u in (blk.unit, *blk.nested):
            if t.unit_first_block[u] == i and u != root:
                enter(u)
        comp += fwd_s[i]
    comp += loss_s

    # ---- backward ----
    bwd_units = (root, *reversed([u for u in fwd_units if u != root]))
    bpos = {u: i for i, u in enumerate(bwd_units)}
    ag_end = [-1.0] * n_units
    bstart = [0.0] * n_units
    done = [False] * n_units

    def issue_ag(u: int, ready: float) -> None:
        nonlocal comm
        if done[u] or not needs_bwd_ag[u]:
            done[u] = True
            return
        comm = max(comm, ready) + ag_bwd[u]
        ag_end[u] = comm
        done[u] = True

    def enter_bwd(u: int) -> None:
        nonlocal comp
        issue_ag(u, comp)
        if needs_bwd_ag[u]:
            wait = max(0.0, ag_end[u] - comp)
            exposed[u] += wait
            comp += wait
        bstart[u] = comp
        i = bpos[u]
        for v in bwd_units[i + 1: i + 1 + (1 if u == root else d_bwd)]:
            issue_ag(v, comp)

    def reduce(u: int) -> None:
        nonlocal comm
        comm = max(comm, comp) + rs[u]

    enter_bwd(root)
    started = {root}
    for i in range(len(blocks) - 1, -1, -1):
        blk = blocks[i]
        for u in (blk.unit, *blk.nested):
            if u not in started and t.unit_last_block[u] == i:
                enter_bwd(u)
                started.add(u)
        comp += bwd_s[i] + rec_s[i]
        for u in (*blk.nested, blk.unit):
            if u != root and t.unit_first_block[u] == i:
                reduce(u)
    reduce(root)
    exposed[root] += max(0.0, comm - comp)  # the optimizer waits for the last reduce-scatter (the root's)
    return max(comp, comm)
