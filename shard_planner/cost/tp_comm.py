"""Tensor-parallel collectives: their seconds per block (the time walk) and their bytes per step (what
``run`` counts beside FSDP2's).

The trace records, per module, the collectives its tensor-parallel style issues on one rank
(trace/types.py ``TPCollective``: kind, forward or backward, the full tensor's bytes per micro-batch);
cost/tables.py gathers them per block (``Block.tp_fwd``, ``Block.tp_bwd``).

[Note: Tensor-parallel collectives are on the critical path]
  Every tensor-parallel collective sits between two computations of the same block that need its result:
  the sequence all-gather before the q/k/v and up projections, the reduce-scatter (or all-reduce) of the
  o/down projections' partial sums before the residual add, and their transposes in backward (torch
  2.13's DTensor redistributes with functional collectives and waits on the result at its first use,
  torch/distributed/tensor/_redistribute.py; the colwise projection uses it at once). Nothing of the
  same rank's compute is independent of it, so each one adds its whole ring time to the block's forward
  or backward on the compute stream (cost/time.py); FSDP2's all-gathers and reduce-scatters still
  overlap on their own stream. Megatron-LM overlaps them with the GEMMs
  (``--tp-comm-overlap``) and torchtitan with async TP under torch.compile; neither is modelled.
  The tp group's ranks are adjacent (shard_planner/parallel/mesh.py), inside one node when the degree is at most
  the node's GPUs: priced over the intra-node link (cost/collectives.py ``tp_collective_time_s``).
  A checkpointed block recomputes its forward with its forward collectives; the recomputation may stop
  before its last ones (trace/capture.py [Note: Early stop of the recomputation]): counted whole, an
  over-estimate of the reduce-scatter after the last saved tensor.
"""

from __future__ import annotations

from shard_planner.plan.comm import CollectiveBytes
from shard_planner.cost.collectives import tp_collective_time_s
from shard_planner.cost.tables import CostTables, tp_collectives_of
from shard_planner.parallel.mesh import Mesh
from shard_planner.plan import Plan
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.trace.types import Affine, ModelTrace

# The device mesh dimension tensor parallelism runs over (parallel/mesh.py ``Mesh.device_mesh_dim_names``): the group
# ``run`` counts DTensor's collectives under (execute/comm_count.py ``group_roles``).
TP_GROUP = "tp"


def collectives_s(collectives: tuple[tuple[str, Affine], ...], micro_batch: int, profile: HardwareProfile,
                  tp: Mesh) -> float:
    """Seconds of ``collectives`` ((kind, full bytes) each) run one after another at ``micro_batch`` over the
    tp group of the layout ``tp``."""
    return sum(tp_collective_time_s(profile, kind, nbytes.at(micro_batch), tp) for kind, nbytes in collectives)


def trace_tp_group(trace: ModelTrace) -> Mesh:
    """The layout of the tp group ``trace`` is one rank of (its degree: parallel/mesh.py ``Mesh.tp_group``)."""
    return Mesh.tp_group(trace.tp_size)


def block_tp_s(t: CostTables, trace: ModelTrace, micro_batch: int, profile: HardwareProfile):
    """Per block of ``t`` its forward and backward tensor-parallel seconds, and the loss's (forward and
    backward together): none (and 0) without tensor parallelism."""
    tp = trace_tp_group(trace)
    if not tp.is_tp:
        return (), (), 0.0
    fwd = tuple(collectives_s(b.tp_fwd, micro_batch, profile, tp) for b in t.blocks)
    bwd = tuple(collectives_s(b.tp_bwd, micro_batch, profile, tp) for b in t.blocks)
    loss = collectives_s(tuple((c.kind, c.full_bytes) for c in trace.loss_tp_collectives), micro_batch, profile, tp)
    return fwd, bwd, loss


def subtree_tp_s(trace: ModelTrace, fqn: str | None, micro_batch: int, profile: HardwareProfile) -> tuple[float, float]:
    """Forward and backward tensor-parallel seconds of ``fqn``'s subtree (the loss's for None, all forward)."""
    tp = trace_tp_group(trace)
    if fqn is None:
        return collectives_s(tuple((c.kind, c.full_bytes) for c in trace.loss_tp_collectives), micro_batch,
                             profile, tp), 0.0
    fwd, bwd = tp_collectives_of(trace.subtree(fqn))
    return collectives_s(fwd, micro_batch, profile, tp), collectives_s(bwd, micro_batch, profile, tp)


def tp_bytes_per_step(plan: Plan, trace: ModelTrace, t: CostTables, checkpointed: tuple[bool, ...]
                      ) -> tuple[CollectiveBytes, ...]:
    """Per rank, the tensor-parallel collectives of one optimizer step of ``plan`` over its tp group, one
    :class:`CollectiveBytes` per kind (sorted): every micro-step's forward, loss and backward ones, a
    checkpointed block's forward ones again ([Note: Tensor-parallel collectives are on the critical
    path]). Sizes as nccl-tests report them (shard_planner/plan/comm.py), rounded to whole bytes per call."""
    if trace.tp_size <= 1:
        return ()
    b = plan.training.micro_batch
    totals: dict[str, tuple[int, int]] = {}

    def add(kind: str, nbytes: Affine, times: int) -> None:
        calls, total = totals.get(kind, (0, 0))
        totals[kind] = (calls + times, total + round(nbytes.at(b)) * times)

    steps = plan.training.accumulation_steps  # every micro-step runs forward, loss and backward
    for blk, ckpt in zip(t.blocks, checkpointed):
        for kind, nbytes in blk.tp_fwd:
            add(kind, nbytes, steps * (2 if ckpt else 1))
        for kind, nbytes in blk.tp_bwd:
            add(kind, nbytes, steps)
    for c in trace.loss_tp_collectives:
        add(c.kind, c.full_bytes, steps)
    return tuple(CollectiveBytes(kind, trace.tp_size, calls, nbytes) for kind, (calls, nbytes) in sorted(totals.items()))
