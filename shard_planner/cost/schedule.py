"""FSDP2's training step as one sequence of typed events, read by both simulators.

``build_schedule(tables, units, prefetch)`` lists, in the order one rank's CPU runs them (torch 2.13,
torch/distributed/fsdp/_fully_shard/), what happens in one steady-state step:

    forward   PRE_FORWARD(root) ALL_GATHER_WAIT(root) ALL_GATHER(next k) ...
              for each block: PRE_FORWARD(u) ALL_GATHER_WAIT(u) ALL_GATHER(next k)  (units starting here)
                              FORWARD(block)
                              RESHARD(u)                                          (units ending here)
              RESHARD(root) (only if the plan says so)  FORWARD_END (the root's post-forward)
    loss      LOSS
    backward  PRE_BACKWARD(root) ALL_GATHER_WAIT(root) ALL_GATHER(next 1)
              for each block, last first: PRE_BACKWARD(u) ALL_GATHER_WAIT(u) ALL_GATHER(next max(1, k))
                                          RECOMPUTE(block) (checkpointed blocks)  BACKWARD(block)
                                          POST_BACKWARD(u)  (reduce-scatter; units starting here)
              POST_BACKWARD(root) (from the final callback)  BACKWARD_END
    optimizer OPTIMIZER

Prefetch rules (see cost/memory.py [Note: Prefetch holds all-gather outputs, not parameters] and the
time model in cost/time.py):

- forward: a unit's pre-forward issues the all-gathers of the next k units in forward order
  (``set_modules_to_forward_prefetch``, k = ``prefetch.forward``). At k = 0 FSDP2 still starts the
  next unit's all-gather early, because the CPU runs ahead of the device and reaches the next
  pre-forward while this unit computes: that issue is an ``implicit`` ALL_GATHER — it overlaps on the
  communication stream (the time simulator issues it) but is allocated, in program order, only at the
  next unit's pre-forward (the memory simulator skips it; ALL_GATHER_WAIT issues what is not pending).
- backward: the root prefetches one unit (FSDP2's default: the executor sets no list on the root);
  every other unit the next max(1, ``prefetch.backward``) in backward order (an empty list means the
  default, one). Both depths and the targets are cost/fsdp2_rules.py's ([Note: Prefetch depth and
  targets]).
- a unit none of whose outputs requires grad (a frozen embedding: ``CostTables.unit_backward``) has no
  pre-backward (no wait, no prefetch of its own), but the unit before it in backward order still
  prefetches it: an ALL_GATHER that no one waits for, dropped at the end of backward
  (docs/frozen_facts.md [Note: Backward prefetch of a group without a pre-backward]);
- nested units start and end at the block of the unit that contains them (cost/tables.py); units
  that never run (no block) have no events, only their parameters; the root reshards after forward
  only when its plan says so (``None``/False for the root means keep).

An ALL_GATHER or ALL_GATHER_WAIT for a unit already gathered (or kept unsharded) is a no-op for the
simulators: whether it is depends on state they track, not on the schedule.

The schedule depends on the segmentation, each unit's reshard and checkpoint policy and the prefetch
depths — not on the micro-batch, the mesh or the dtypes — so a CostModel memoises it per
``(units, prefetch)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from shard_planner.cost import fsdp2_rules  # called through the module: a test changes a rule, every caller follows
from shard_planner.cost.reshard import reshards_after_forward
from shard_planner.cost.tables import CostTables
from shard_planner.plan import Prefetch, Unit

class Phase(enum.StrEnum):
    """The part of the step an event belongs to. A str enum: its value is the word the memory timeline's
    labels, the report's plots and the timeline's JSON show ("forward: all-gather layers.3")."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class EventKind(enum.IntEnum):
    """What happens (an int, so that the simulators can dispatch on it by list index)."""

    PRE_FORWARD = 0  # a unit's pre-forward hook
    ALL_GATHER = 1  # an all-gather is issued (prefetch)
    ALL_GATHER_WAIT = 2  # wait for a unit's all-gather and copy it out (issues it if not yet)
    FORWARD = 3  # a block's forward
    RESHARD = 4  # a unit reshards after forward (True or to an int group)
    FORWARD_END = 5  # the root's post-forward: the end of forward
    LOSS = 6  # the loss's forward and backward
    PRE_BACKWARD = 7  # a unit's pre-backward hook
    RECOMPUTE = 8  # a checkpointed block recomputes its forward
    BACKWARD = 9  # a block's backward
    POST_BACKWARD = 10  # a unit's post-backward: reshard, reduce-scatter its gradients
    BACKWARD_END = 11  # the end of backward (the last reduce-scatter's wait)
    OPTIMIZER = 12  # the optimizer step and zero_grad


class Event(NamedTuple):
    """One event of the step. A named tuple, not a frozen dataclass: a schedule holds a few hundred and the
    planner builds one per plan it judges (a frozen dataclass's ``__init__`` costs ~5x a tuple's)."""

    kind: EventKind
    phase: Phase
    unit: int = -1  # index into the plan's units (-1: none)
    block: int = -1  # index into the tables' blocks (-1: none; a unit's event: the block where it happens)
    implicit: bool = False  # ALL_GATHER only: FSDP2's implicit forward prefetch (see the module docstring)


@dataclass(frozen=True)
class Schedule:
    events: tuple[Event, ...]
    root: int  # index of the root unit
    forward_units: tuple[int, ...]  # units in pre-forward order, the root first (CostTables.forward_units)
    backward_units: tuple[int, ...]  # units in pre-backward order: the root, then the others reversed
    checkpointed: tuple[bool, ...]  # per block: activation-checkpointed (its unit's policy, a unit module)
    forward_depth: int  # explicit forward prefetch k
    forward_depth_effective: int  # max(1, k): with FSDP2's implicit prefetch
    backward_depth: int  # max(1, prefetch.backward)
    prefetched_in_backward: frozenset[int] = frozenset()  # units some pre-backward prefetches


def build_schedule(t: CostTables, units: tuple[Unit, ...], prefetch: Prefetch) -> Schedule:
    """The event sequence of one step for ``units`` segmented as ``t`` (see the module docstring)."""
    root = next(i for i, u in enumerate(units) if u.is_root)
    blocks = t.blocks
    fwd_units = t.forward_units
    bwd_units = (root, *reversed([u for u in fwd_units if u != root]))
    k_fwd = prefetch.forward
    k_fwd_eff = fsdp2_rules.effective_prefetch_depth(k_fwd)  # [Note: Prefetch depth and targets]
    k_bwd = fsdp2_rules.effective_prefetch_depth(prefetch.backward)
    ckpt = tuple(bool(units[b.unit].activation_checkpoint and b.unit_module) for b in blocks)
    ev: list[Event] = []
    fpos = {u: i for i, u in enumerate(fwd_units)}
    bpos = {u: i for i, u in enumerate(bwd_units)}

    def pre_forward(u: int, block: int) -> None:
        ev.append(Event(EventKind.PRE_FORWARD, Phase.FORWARD, u, block))
        ev.append(Event(EventKind.ALL_GATHER_WAIT, Phase.FORWARD, u, block))
        i = fpos[u]
        for j, v in enumerate(fsdp2_rules.explicit_prefetch(fwd_units, i, k_fwd_eff)):
            ev.append(Event(EventKind.ALL_GATHER, Phase.FORWARD, v, block, implicit=j >= k_fwd))

    def pre_backward(u: int, block: int) -> None:
        if not t.unit_backward[u]:  # no output requires grad: FSDP2 registers no pre-backward hook
            return
        ev.append(Event(EventKind.PRE_BACKWARD, Phase.BACKWARD, u, block))
        ev.append(Event(EventKind.ALL_GATHER_WAIT, Phase.BACKWARD, u, block))
        for v in fsdp2_rules.backward_prefetch_targets(bwd_units, bpos[u], prefetch.backward):
            ev.append(Event(EventKind.ALL_GATHER, Phase.BACKWARD, v, block))

    pre_forward(root, -1)
    for i, blk in enumerate(blocks):
        for u in (blk.unit, *blk.nested):
            if t.unit_first_block[u] == i and u != root:
                pre_forward(u, i)
        ev.append(Event(EventKind.FORWARD, Phase.FORWARD, blk.unit, i))
        for u in (*blk.nested, blk.unit):
            if t.unit_last_block[u] == i and u != root and reshards_after_forward(units[u].reshard_after_forward):
                ev.append(Event(EventKind.RESHARD, Phase.FORWARD, u, i))
    if reshards_after_forward(units[root].reshard_after_forward):
        ev.append(Event(EventKind.RESHARD, Phase.FORWARD, root))
    ev.append(Event(EventKind.FORWARD_END, Phase.FORWARD, root))
    ev.append(Event(EventKind.LOSS, Phase.BACKWARD))

    pre_backward(root, -1)
    started = {root}
    for i in range(len(blocks) - 1, -1, -1):
        blk = blocks[i]
        for u in (blk.unit, *blk.nested):
            if u not in started and t.unit_last_block[u] == i:
                pre_backward(u, i)
                started.add(u)
        if ckpt[i]:
            ev.append(Event(EventKind.RECOMPUTE, Phase.BACKWARD, blk.unit, i))
        ev.append(Event(EventKind.BACKWARD, Phase.BACKWARD, blk.unit, i))
        for u in (*blk.nested, blk.unit):
            if u != root and t.unit_first_block[u] == i:
                ev.append(Event(EventKind.POST_BACKWARD, Phase.BACKWARD, u, i))
    ev.append(Event(EventKind.POST_BACKWARD, Phase.BACKWARD, root))
    ev.append(Event(EventKind.BACKWARD_END, Phase.BACKWARD, root))
    ev.append(Event(EventKind.OPTIMIZER, Phase.OPTIMIZER))
    prefetched = frozenset(e.unit for e in ev if e.kind is EventKind.ALL_GATHER and e.phase is Phase.BACKWARD)
    return Schedule(events=tuple(ev), root=root, forward_units=fwd_units, backward_units=bwd_units,
                    checkpointed=ckpt, forward_depth=k_fwd, forward_depth_effective=k_fwd_eff,
                    backward_depth=k_bwd, prefetched_in_backward=prefetched)
