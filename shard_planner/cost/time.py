"""Step time of one FSDP2 training step: compute from traced FLOPs, collectives from the ring model,
and a two-stream simulation of their overlap.

Compute: each block's traced forward and backward FLOPs at ``profile.flops_per_s(param dtype)`` (peak
x efficiency); a checkpointed block runs its forward again before its backward, up to its last saved
tensor (trace/capture.py [Note: Early stop of the recomputation]; a selectively checkpointed one only the
ops it did not store: cost/selective.py); the loss's FLOPs run between
forward and backward. On a GPU profile with a ``[kernels]`` table and a trace with kernel
records, a block's device time is instead its kernels priced one by one by the roofline kernel model
(shard_planner/cost/kernels.py; CostModel.kernel_module_s).

Communication (shard_planner/cost/collectives.py): per unit, an all-gather of its unsharded bytes in
the param dtype before its forward, another before its backward when it resharded after forward (over
r ranks for ``reshard_after_forward=r``), and a reduce-scatter of its gradients in the reduce dtype
after its backward (plus the replica all-reduce under HSDP). Under CPU offload every all-gather first
copies the fp32 shard host-to-device and every reduce-scatter copies the sharded gradient back.

Overlap (GPU): one compute stream and one communication stream, FIFO in the order the CPU issues
work, walking the step's event sequence (shard_planner/cost/schedule.py), with FSDP2's dependencies:

- a unit computes only once its all-gather has finished;
- forward: the all-gather of the k-th next unit is issued when the current unit starts
  (``set_modules_to_forward_prefetch``, depth k); FSDP2's implicit prefetch — the CPU runs ahead and
  issues the next unit's all-gather while the current one computes — gives an effective depth of 1
  when k is 0;
- backward: the root prefetches one unit (FSDP2's default); each unit prefetches the next
  max(1, k) in backward order;
- a reduce-scatter starts after its unit's backward; the optimizer step after the last one.

FSDP2's copies run on the compute stream (shard_planner/cost/fsdp_copies.py [Note: FSDP2's copies on
the compute stream]): a unit's all-gather copy-out after the compute stream waits for its all-gather (in
forward, and in backward when it resharded), its reduce-scatter copy-in before the reduce-scatter is
issued; their time counts as the unit's exposed communication (0 on a CPU profile).

Compute that runs while the communication stream is busy runs slower: NCCL's kernels hold SMs and HBM
bandwidth beside it (the profile's ``overlap_compute_slowdown``; shard_planner/cost/overlap.py [Note:
Compute slowdown under overlapped collectives]). The time that adds counts as exposed communication
(``TimeEstimate.exposed_comm_s`` = step - compute alone - optimizer), per unit at the unit whose
compute was slowed; 0 prices exactly as before.

On a CPU profile (gloo, synchronous collectives on the one thread that also computes) nothing
overlaps: the step is the sum of compute, communication and the optimizer. When the plan's ranks
outnumber the host's cores, the CostModel hands this module a profile whose rates and overheads are
already scaled to each rank's share of a core (cost/host_share.py [Note: CPU ranks sharing cores]).

Framework overhead (the profile's ``per_op_overhead_s``, ``per_unit_overhead_s``,
``per_param_tensor_optimizer_overhead_s``; measured by ``shard-planner calibrate``, see
shard_planner/execute/calibrate.py). Each block has a *host* time: its traced aten ops
(``fwd_ops_self`` / ``bwd_ops_self`` summed over the block) x per-op overhead, plus half the per-unit
overhead of every unit whose pre-forward runs at the block (FSDP2's pre/post-forward hooks and
all-gather copy-out) and, in backward, the other half at the block where the unit's backward starts
(pre/post-backward hooks, reduce-scatter copies). The loss adds its ops. On a CPU profile the host is
the device: a block takes FLOPs / throughput + its memory-bound kernels' bytes / bandwidth (cost/kernels.py
[Note: memory-bound kernels on a CPU priced from FLOPs]) + host time. On a GPU the host launches asynchronously and
runs ahead, so a block takes max(FLOPs / throughput, host time): the overhead shows only where the
kernels are too small to hide it (small models, small micro-batches). A checkpointed block's
recomputation runs its forward ops again but not FSDP2's hooks (its pre-forward returns at once during
backward: torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _pre_forward). The optimizer step adds per-tensor
overhead x the model's parameter tensors (each rank steps every tensor, sharded). Traces written
before op counts (all zero) get no overhead.

Measured module times (``profile.module_timings``, from ``shard-planner calibrate --model``; see
shard_planner/hardware/timings.py and shard_planner/execute/module_timing.py): a block whose module was timed on
the device takes its measured forward and backward at the plan's micro-batch instead of FLOPs /
throughput + ops x per-op overhead — the measurement holds both (a module block: its subtree's time; a
container's own operations, a ``self_only`` block: the container less its nearest timed descendants). A
checkpointed block recomputes with its measured forward; the loss takes its measured forward + backward.
FSDP2's per-unit overhead, the collectives and the optimizer stay as above; blocks the timings lack fall
back to FLOPs.
The timings must be for the trace's model (structure fingerprint) and the plan's param dtype, else one
ProfileError line, checked once per param dtype by the CostModel. Per-block measured times are
computed once per segmentation (``measured_block_times``, memoised by the CostModel).

Per-block compute seconds come from ONE function, ``CostModel.block_compute_s`` (device time from FLOPs
or measurements, and host time from op counts): replace it to price compute another way.

The optimizer step is bound by memory bandwidth: bytes touched per sharded element by the foreach
implementation (OPTIMIZER_BYTES_PER_ELEMENT) / ``memory_bandwidth_bytes_per_s`` (the host's under CPU
offload, where the step runs on the host), plus its per-tensor overhead (below).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shard_planner.cost import optimizer as optimizer_rules
from shard_planner.cost.overlap import overlapped_compute_end_s
from shard_planner.cost.queries import PlanQuery
from shard_planner.cost.reshard import reshards_after_forward
from shard_planner.cost.schedule import EventKind, Phase, Schedule
from shard_planner.cost.stragglers import straggler_factor
from shard_planner.cost.tables import CostTables
from shard_planner.cost.types import TimeEstimate, UnitTime
from shard_planner.cost.unit_cost import UnitCost
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.hardware.timings import ModuleTime, ModuleTimings
from shard_planner.trace.types import ModelTrace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockCompute:
    """Per block of the tables (forward order), seconds of one step at one micro-batch: device time
    (kernels: FLOPs / throughput, or measured) and host time (aten ops x per-op overhead; 0 for a
    measured block, whose time holds it). ``CostModel.block_compute_s`` builds it."""

    device_fwd_s: tuple[float, ...]
    device_bwd_s: tuple[float, ...]
    ops_fwd_s: tuple[float, ...]
    ops_bwd_s: tuple[float, ...]
    loss_device_s: float
    loss_host_s: float
    # tensor-parallel collectives per block and the loss's, on the compute stream's critical path
    # (cost/tp_comm.py [Note: Tensor-parallel collectives are on the critical path]); () and 0 without TP
    tp_fwd_s: tuple[float, ...] = ()
    tp_bwd_s: tuple[float, ...] = ()
    loss_tp_s: float = 0.0


def measured_block_times(trace: ModelTrace, t: CostTables, timings: ModuleTimings) -> tuple[ModuleTime | None, ...]:
    """Per block of ``t``, its measured time: a module block's subtree time, a ``self_only`` block's
    container time less its nearest timed descendants' (``ModuleTimings.self_time``); None where the
    timings lack the module (priced from FLOPs). The CostModel memoises it per segmentation."""
    children = {m.fqn: m.children for m in trace.modules}
    out = []
    for blk in t.blocks:
        if blk.self_only:
            out.append(timings.self_time(blk.fqn, children))
        else:
            out.append(timings.modules.get(blk.fqn))
    return tuple(out)


def unit_collectives_s(costs: tuple[UnitCost, ...]):
    """Per unit of ``costs`` (cost/unit_cost.py): forward all-gather, backward all-gather (0 when it
    keeps its parameters; the root never reshards unless the plan says so) and reduce-scatter (+ the HSDP
    all-reduce) seconds, each with its host copy under CPU offload — what the two-stream walk reads."""
    return (tuple(c.collectives.forward_s for c in costs), tuple(c.collectives.backward_s for c in costs),
            tuple(c.collectives.reduction_s for c in costs))


def unit_copies_s(costs: tuple[UnitCost, ...]):
    """Per unit of ``costs``: one all-gather's copy-out and the reduce-scatter's copy-in on the compute
    stream (cost/fsdp_copies.py), seconds."""
    return tuple(c.copy_out_s for c in costs), tuple(c.copy_in_s for c in costs)


def _combine(t: CostTables, s: Schedule, c: BlockCompute, profile: HardwareProfile, skipped=None,
             n_gpus: int = 1):
    """Per-block forward, backward and recompute seconds, and the loss's: device and host time
    combined (a CPU computes both in turn; a GPU's host runs ahead, so the slower one counts), plus
    half FSDP2's per-unit overhead at a unit's first block in forward and at its last in backward.
    On a GPU the device time is the slowest of the job's ``n_gpus`` GPUs' (cost/stragglers.py)."""
    n_blocks = len(t.blocks)
    host_fwd, host_bwd = list(c.ops_fwd_s), list(c.ops_bwd_s)
    half_unit_s = profile.per_unit_overhead_s / 2
    if half_unit_s:
        for u in t.forward_units:  # units that run: their hooks fire once per step each way
            host_fwd[t.unit_first_block[u]] += half_unit_s
            host_bwd[t.unit_last_block[u]] += half_unit_s
    dev_fwd, dev_bwd, ops_fwd, ckpt = c.device_fwd_s, c.device_bwd_s, c.ops_fwd_s, s.checkpointed
    # selective: the stored ops are not recomputed (cost/selective.py [Note: Selective checkpointing time])
    dev_rec = dev_fwd if skipped is None else [d * (1.0 - k) for d, k in zip(dev_fwd, skipped)]
    if profile.device == "cpu":  # the host computes: overhead adds up
        rec_s = [dev_rec[i] + ops_fwd[i] if ckpt[i] else 0.0 for i in range(n_blocks)]
        fwd_s = [dev_fwd[i] + host_fwd[i] for i in range(n_blocks)]
        bwd_s = [dev_bwd[i] + host_bwd[i] for i in range(n_blocks)]
        loss_s = c.loss_device_s + c.loss_host_s
    else:  # asynchronous launch: the slower of the GPU's work and the host's issuing it
        # every rank waits for the slowest GPU ([Note: Stragglers: the slowest of N GPUs]); 1 by default
        k = straggler_factor(n_gpus, profile.gpu_speed_spread)
        rec_s = [max(k * dev_rec[i], ops_fwd[i]) if ckpt[i] else 0.0 for i in range(n_blocks)]
        fwd_s = [max(k * dev_fwd[i], host_fwd[i]) for i in range(n_blocks)]
        bwd_s = [max(k * dev_bwd[i], host_bwd[i]) for i in range(n_blocks)]
        loss_s = max(k * c.loss_device_s, c.loss_host_s)
    if c.tp_fwd_s:  # after the device/host combination: the compute stream waits for each one
        fwd_s = [f + x for f, x in zip(fwd_s, c.tp_fwd_s)]
        bwd_s = [b + x for b, x in zip(bwd_s, c.tp_bwd_s)]
        rec_s = [r + x if ckpt[i] else r for i, (r, x) in enumerate(zip(rec_s, c.tp_fwd_s))]
        loss_s += c.loss_tp_s
    return fwd_s, bwd_s, rec_s, loss_s


def simulate_time_walk(trace: ModelTrace, t: CostTables, plan: PlanQuery, profile: HardwareProfile,
                       schedule: Schedule, compute: BlockCompute, collectives, selective=None,
                       copies=None) -> TimeEstimate:
    """Predicted time of one training step on one rank (module docstring); CostModel.time calls it.
    ``collectives``: ``unit_collectives_s(unit costs)``; ``selective``: the share of
    selectively checkpointed blocks' forward their recomputation skips (cost/selective.py);
    ``copies``: ``unit_copies_s(unit costs)`` (cost/fsdp_copies.py), each applied where its
    collective runs (None: none)."""
    training = plan.training
    b = training.micro_batch
    n_units = len(plan.units)
    ag_fwd, ag_bwd, rs = collectives
    # a unit without a pre-backward all-gathers in backward only when another prefetches it (schedule.py)
    needs_bwd_ag = [reshards_after_forward(plan.units[u].reshard_after_forward)
                    and (t.unit_backward[u] or u in schedule.prefetched_in_backward) for u in range(n_units)]
    fwd_s, bwd_s, rec_s, loss_s = _combine(t, schedule, compute, profile,
                                           selective.skipped_share if selective is not None else None,
                                           plan.mesh.world_size)
    unit_fwd = [0.0] * n_units
    unit_bwd = [0.0] * n_units
    # tensor-parallel seconds inside the unit's blocks, forward and backward (recomputation included):
    # in the blocks' times above, reported as exposed communication, not compute
    tp_f, tp_b = [0.0] * n_units, [0.0] * n_units
    for i, blk in enumerate(t.blocks):
        unit_fwd[blk.unit] += fwd_s[i]
        unit_bwd[blk.unit] += bwd_s[i] + rec_s[i]
        if compute.tp_fwd_s:
            tp_f[blk.unit] += compute.tp_fwd_s[i]
            tp_b[blk.unit] += compute.tp_bwd_s[i] + (compute.tp_fwd_s[i] if schedule.checkpointed[i] else 0.0)
    tp_s = sum(tp_f) + sum(tp_b) + compute.loss_tp_s
    compute_s = sum(unit_fwd) + sum(unit_bwd) + loss_s - tp_s

    # ---- optimizer: memory-bound, plus per-tensor overhead ----
    optimizer_s = (optimizer_rules.model_step_s(training.optimizer, t.model_params, plan.mesh.shard_group_size,
                                                profile, training.cpu_offload, training.numerics)
                   + t.param_tensors * profile.per_param_tensor_optimizer_overhead_s)

    comm_s = sum(ag_fwd) + sum(ag_bwd[u] for u in range(n_units) if needs_bwd_ag[u]) + sum(rs)
    if profile.device == "cpu":
        # gloo collectives are synchronous on the thread that computes: nothing overlaps.
        exposed = [ag_fwd[u] + (ag_bwd[u] if needs_bwd_ag[u] else 0.0) + rs[u] for u in range(n_units)]
        copied = slowed = [0.0] * n_units
        step_s = compute_s + tp_s + comm_s + optimizer_s  # the blocks' TP collectives run in turn too
    else:
        zeros = (0.0,) * n_units
        copy_out, copy_in = copies if copies is not None else (zeros, zeros)
        streams = _TwoStreams(schedule, _BlockSeconds(fwd_s, bwd_s, rec_s, loss_s),
                              _UnitComm(ag_fwd, ag_bwd, rs, needs_bwd_ag, copy_out, copy_in),
                              profile.overlap_compute_slowdown)
        step_s = streams.run() + optimizer_s
        exposed, copied, slowed = streams.exposed, streams.copied, streams.slowed

    samples = b * plan.mesh.dp_size
    model_flops = (t.model_fwd_flops.at(b) + t.model_bwd_flops.at(b) + trace.loss_flops.at(b))
    compute = training.numerics.compute_dtype  # MFU against the peak of the dtype the model computes in
    peak = profile.peak_flops_per_s.get(compute) or profile.flops_per_s(compute)
    units = tuple(
        UnitTime(name=plan.units[u].name, fwd_compute_s=unit_fwd[u] - tp_f[u], bwd_compute_s=unit_bwd[u] - tp_b[u],
                 all_gather_s=ag_fwd[u] + (ag_bwd[u] if needs_bwd_ag[u] else 0.0),
                 reduce_scatter_s=rs[u], exposed_comm_s=exposed[u] + tp_f[u] + tp_b[u],
                 copies_s=copied[u], slowdown_s=slowed[u], tp_s=tp_f[u] + tp_b[u])
        for u in range(n_units)
    )
    return TimeEstimate(
        step_time_s=step_s, compute_s=compute_s, comm_s=comm_s + tp_s, tp_comm_s=tp_s,
        exposed_comm_s=max(0.0, step_s - compute_s - optimizer_s), optimizer_s=optimizer_s,
        samples_per_s=samples / step_s if step_s > 0 else 0.0,
        tokens_per_s=samples * trace.tokens_per_sample / step_s if trace.tokens_per_sample and step_s > 0 else None,
        mfu=model_flops / (step_s * peak) if step_s > 0 else 0.0,
        units=units,
    )


@dataclass(frozen=True)
class _BlockSeconds:
    """Per block of the schedule, its forward, backward and recomputation seconds; and the loss's."""

    fwd_s: list[float]
    bwd_s: list[float]
    rec_s: list[float]
    loss_s: float


@dataclass(frozen=True)
class _UnitComm:
    """Per unit, its collectives' seconds (forward and backward all-gather, reduce-scatter with the HSDP
    all-reduce), whether it all-gathers in backward, and FSDP2's copies on the compute stream (one
    copy-out, the reduce-scatter copy-in): the per-unit cost query's (cost/unit_cost.py)."""

    ag_fwd: tuple[float, ...]
    ag_bwd: tuple[float, ...]
    rs: tuple[float, ...]
    needs_bwd_ag: list[bool]
    copy_out: tuple[float, ...]
    copy_in: tuple[float, ...]


class _TwoStreams:
    """A compute stream and a FIFO communication stream walking one schedule. ``run`` returns the
    time the last reduce-scatter and the last compute have both finished; ``exposed[u]`` accumulates
    the compute stream's wait for unit u's all-gathers (and, for the root, the optimizer's wait for
    the last reduce-scatter). Compute that runs while the communication stream is busy runs
    1 / (1 + ``slowdown``) as fast (cost/overlap.py [Note: Compute slowdown under overlapped
    collectives]); the time that adds counts as exposed communication of the unit it slowed. FSDP2's
    copies (``copies``: per unit, one copy-out and the reduce-scatter copy-in) run on the compute stream
    where their collective runs, as exposed communication of their unit."""

    def __init__(self, schedule: Schedule, blocks: _BlockSeconds, comm: _UnitComm, slowdown: float = 0.0):
        self.s = schedule
        self.slowdown = slowdown
        self.copy_out, self.copy_in = comm.copy_out, comm.copy_in
        self.fwd_s, self.bwd_s, self.rec_s, self.loss_s = blocks.fwd_s, blocks.bwd_s, blocks.rec_s, blocks.loss_s
        self.ag_fwd, self.ag_bwd, self.rs, self.needs_bwd_ag = comm.ag_fwd, comm.ag_bwd, comm.rs, comm.needs_bwd_ag
        n_units = len(comm.ag_fwd)
        self.exposed = [0.0] * n_units
        # of it: FSDP2's copies and the slowdown (cost/types.py [Note: The parts of exposed communication])
        self.copied = [0.0] * n_units
        self.slowed = [0.0] * n_units
        self.comp = 0.0  # compute stream: free from this time on
        self.comm = 0.0  # communication stream
        self.ag_end = [-1.0] * n_units  # when the unit's current all-gather finishes
        self.start = [0.0] * n_units  # forward: compute start of each unit (its pre-forward)
        self.fpos = {u: i for i, u in enumerate(schedule.forward_units)}
        self.issued = 0  # forward: forward_units[:issued] have their all-gather issued (in order)
        self.done = [False] * n_units  # backward: all-gather issued (or not needed)

    def run(self) -> float:
        K = EventKind
        handlers: list = [_ignore] * len(K)  # indexed by the kind (an IntEnum); the rest take no time
        handlers[K.FORWARD], handlers[K.BACKWARD], handlers[K.LOSS] = self.forward, self.backward, self.loss
        handlers[K.ALL_GATHER], handlers[K.ALL_GATHER_WAIT] = self.all_gather, self.wait
        handlers[K.POST_BACKWARD], handlers[K.BACKWARD_END] = self.post_backward, self.backward_end
        for ev in self.s.events:
            handlers[ev.kind](ev)
        return max(self.comp, self.comm)

    def compute(self, work_s: float, unit: int) -> None:
        """Run ``work_s`` seconds of ``unit``'s compute, slowed while the communication stream is busy;
        the time the slowdown adds counts as ``unit``'s exposed communication."""
        if self.slowdown and self.comm > self.comp:
            end = overlapped_compute_end_s(self.comp, work_s, self.comm, self.slowdown)
            self.exposed[unit] += end - self.comp - work_s
            self.slowed[unit] += end - self.comp - work_s
            self.comp = end
        else:
            self.comp += work_s

    def copy(self, work_s: float, unit: int) -> None:
        """One of FSDP2's copies of ``unit`` on the compute stream: exposed communication of the unit."""
        if work_s > 0.0:
            self.compute(work_s, unit)
            self.exposed[unit] += work_s  # compute() counted only what the slowdown added
            self.copied[unit] += work_s

    def forward(self, ev) -> None:
        self.compute(self.fwd_s[ev.block], ev.unit)

    def backward(self, ev) -> None:  # a checkpointed block's recomputation runs right before: one sum
        self.compute(self.bwd_s[ev.block] + self.rec_s[ev.block], ev.unit)

    def loss(self, ev) -> None:
        self.compute(self.loss_s, self.s.root)

    def all_gather(self, ev) -> None:
        if ev.phase is Phase.FORWARD:
            self.forward_all_gather(ev.unit, False)
        else:
            self.backward_all_gather(ev.unit, False)

    def wait(self, ev) -> None:
        if ev.phase is Phase.FORWARD:
            self.forward_all_gather(ev.unit, True)
        else:
            self.backward_all_gather(ev.unit, True)

    def post_backward(self, ev) -> None:  # the reduce-scatter follows the unit's backward and its copy-in
        if self.rs[ev.unit] > 0.0:
            self.copy(self.copy_in[ev.unit], ev.unit)
        self.comm = max(self.comm, self.comp) + self.rs[ev.unit]

    def backward_end(self, ev) -> None:  # the optimizer waits for the last reduce-scatter (the root's)
        self.exposed[ev.unit] += max(0.0, self.comm - self.comp)

    def forward_all_gather(self, u: int, wait: bool) -> None:
        """Issue (in forward order, FIFO) every all-gather up to ``u``'s; at a wait, the compute stream
        waits for it and the unit starts."""
        order, d = self.s.forward_units, self.s.forward_depth_effective
        j_max = min(self.fpos[u], len(order) - 1)
        while self.issued <= j_max:
            v = order[self.issued]
            k = self.issued - d  # the unit whose pre-forward issues this all-gather
            ready = self.start[order[k]] if k >= 0 else 0.0
            self.comm = max(self.comm, ready) + self.ag_fwd[v]
            self.ag_end[v] = self.comm
            self.issued += 1
        if wait:
            w = max(0.0, self.ag_end[u] - self.comp)
            self.exposed[u] += w
            self.comp += w
            if self.ag_fwd[u] > 0.0:
                self.copy(self.copy_out[u], u)
            self.start[u] = self.comp

    def backward_all_gather(self, u: int, wait: bool) -> None:
        if not self.done[u]:
            self.done[u] = True
            if self.needs_bwd_ag[u]:
                self.comm = max(self.comm, self.comp) + self.ag_bwd[u]
                self.ag_end[u] = self.comm
        if wait and self.needs_bwd_ag[u]:
            w = max(0.0, self.ag_end[u] - self.comp)
            self.exposed[u] += w
            self.comp += w
            if self.ag_bwd[u] > 0.0:
                self.copy(self.copy_out[u], u)


def _ignore(ev) -> None:
    """Events that take no time on either stream (hooks whose cost is in the per-unit overhead)."""
