"""Bytes each rank sends through FSDP2's collectives in one training step, per plan: the prediction that
``shard-planner run`` puts beside the bytes it counts (execute/comm_count.py).

One function, :func:`collective_bytes_per_step`, from the plan (units, reshard policies, mesh, dtypes)
and the shapes of the parameters each unit owns. The sizes follow torch 2.13's FSDP2
(torch/distributed/fsdp/_fully_shard/):

- padding: a parameter is sharded on dim 0 with ``torch.chunk`` over the shard group of N ranks, and
  every rank's shard is padded to the first chunk's size, so the all-gather output and the
  reduce-scatter input of a parameter of shape (d0, ...) hold ``ceil(d0 / N) * N * numel / d0``
  elements (cost/fsdp2_rules.py ``padded_numel``, [Note: Dim-0 padding]);
- all-gather (``foreach_all_gather``: one ``all_gather_single`` per unit): the unit's parameters in the
  plan's param dtype (MixedPrecisionPolicy casts floating parameters; others keep their dtype), once in
  forward and, for a unit that reshards after forward, once more in backward — over the shard group
  (True) or over the smaller group it resharded to (an int r: ``_all_gather_process_group`` is the
  post-forward mesh's); a unit kept unsharded (False; the root's None) is not gathered again
  (cost/fsdp2_rules.py ``unit_collectives_of``, [Note: The collectives of each reshard policy]);
- reduce-scatter (``foreach_reduce``: one ``reduce_scatter_single`` per unit) of the unit's trainable
  floating parameters' gradients in the reduce dtype, over the shard group; none for a unit whose
  parameters are all frozen (``FSDPParamGroup.post_backward`` returns before it: docs/frozen_facts.md
  [Note: Reduce-scatter of parameters with a gradient only]); frozen parameters are all-gathered like
  the others ([Note: Frozen parameters are all-gathered]);
- HSDP: an ``all_reduce`` of each unit's reduce-scatter output (1/N of it) across the R replicas;
- a group of one rank moves nothing: FSDP2 skips the all-gather and the reduce-scatter when the shard
  group has one rank (``FSDPParamGroup.unshard``, ``foreach_reduce``), so none is counted;
- 0-d parameters are replicated, not sharded (execute/apply.py, [Note: 0-d parameters]): each one's
  gradient is all-reduced over each mesh dimension of more than one rank, in its built dtype.

A collective's size is its message size as nccl-tests report it (cost/collectives.py): the full output
of an all-gather, the full input of a reduce-scatter, the buffer of an all-reduce. Bytes are summed per
(collective, group size).

Assumptions (what the count cannot see from the plan): every unit's forward runs once per step (the
trace's ``calls``; a module called twice in one step gathers twice); every trainable floating parameter
gets a gradient; a unit that reshards all-gathers in backward, except a unit none of whose outputs
requires grad (a frozen embedding, a frozen first block) that no unit with a pre-backward prefetches
(:func:`gathers_in_backward`; docs/frozen_facts.md [Note: Backward prefetch of a group without a
pre-backward]). A unit nested inside an activation-checkpointed unit may re-run its pre-forward during the
recompute, and with an explicit forward prefetch list that issues all-gathers of later units again;
that is not modelled (``run`` shows the measured bytes beside these).
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.plan.comm import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CollectiveBytes
from shard_planner.cost.accumulation import micro_steps
from shard_planner.cost import fsdp2_rules  # called through the module: a test changes a rule, every caller follows
from shard_planner.cost.reshard import ReshardAfterForward
from shard_planner.dtypes import FLOAT_DTYPES, dtype_bytes
from shard_planner.plan import Plan
from shard_planner.plan.engine import SINGLE


@dataclass(frozen=True)
class ParamShape:
    """One parameter as built: its dim-0 size, its number of elements, dtype name ("float32") and whether
    it trains (``requires_grad``)."""

    dim0: int
    numel: int
    dtype: str
    trainable: bool = True


def _add(totals: dict, collective: str, group_size: int, nbytes: int, times: int = 1) -> None:
    if group_size <= 1:  # nothing moves (FSDP2 skips it; a 1-rank all-reduce is not counted either)
        return
    calls, total = totals.get((collective, group_size), (0, 0))
    totals[(collective, group_size)] = (calls + times, total + nbytes * times)


def gathers_in_backward(plan: Plan, has_backward: tuple[bool, ...] | None) -> tuple[bool, ...]:
    """Per unit of ``plan`` (if it reshards after forward), whether it is all-gathered in backward: it
    runs a pre-backward (``has_backward``; None: every unit does), or a unit that does prefetches it —
    the units cost/fsdp2_rules.py ``backward_prefetch_targets`` names (docs/frozen_facts.md [Note: Backward
    prefetch of a group without a pre-backward])."""
    if has_backward is None:
        return (True,) * len(plan.units)
    root = next(i for i, u in enumerate(plan.units) if u.is_root)
    order = [root, *reversed([i for i in range(len(plan.units)) if i != root])]
    gathered = list(has_backward)
    for k, u in enumerate(order):
        if has_backward[u]:
            for v in fsdp2_rules.backward_prefetch_targets(order, k, plan.prefetch.backward):
                gathered[v] = True
    return tuple(gathered)


def collective_bytes_per_step(plan: Plan, unit_params: tuple[tuple[ParamShape, ...], ...],
                              scalar_params: tuple[ParamShape, ...] = (),
                              has_backward: tuple[bool, ...] | None = None) -> tuple[CollectiveBytes, ...]:
    """Per rank, the all-gathers, reduce-scatters and all-reduces of one steady-state step of ``plan``.

    ``unit_params[i]``: the parameters FSDP2 shards in ``plan.units[i]`` (those its modules register that
    no nested unit owns; 0-d ones left out); ``scalar_params``: the model's 0-d parameters;
    ``has_backward[i]``: whether the unit runs a pre-backward (:func:`gathers_in_backward`; None: all).
    Returns one :class:`CollectiveBytes` per (collective, group size), sorted; see the module docstring.
    """
    if len(unit_params) != len(plan.units):
        raise ValueError(f"{len(unit_params)} parameter lists for {len(plan.units)} units")
    if plan.engine == SINGLE:
        return ()  # one device: no collectives (plan/engine.py)
    n, replicas = plan.mesh.shard_group_size, plan.mesh.replicate_group_size
    numerics = plan.training.numerics  # each tensor's dtype (plan/numerics.py)
    reduce_elem = dtype_bytes(numerics.reduce_scatter_dtype)
    totals: dict[tuple[str, int], tuple[int, int]] = {}
    # gradient accumulation (cost/accumulation.py): each micro-step gathers, its forward not when the one
    # before kept the parameters gathered; it reduces only when it syncs; 0-d gradients every micro-step
    for step in micro_steps(plan.training):
        k = step.repeats
        for unit, params, in_backward in zip(plan.units, unit_params, gathers_in_backward(plan, has_backward)):
            if not params:
                continue  # no parameter group: FSDP2 issues nothing for it
            gathered = sum(fsdp2_rules.padded_numel(p.dim0, p.numel, n) * dtype_bytes(numerics.gathered_dtype(p.dtype))
                           for p in params)
            trained = [p for p in params if p.dtype in FLOAT_DTYPES and p.trainable]
            reduced = sum(fsdp2_rules.padded_numel(p.dim0, p.numel, n) * reduce_elem for p in trained)
            # the forward all-gather, the backward one (over the shard group or the 1/r post-forward
            # shards' group; none when kept) and the reduce-scatter: cost/fsdp2_rules.py
            for c in fsdp2_rules.unit_collectives_of(ReshardAfterForward.of(unit.reshard_after_forward, n), n):
                if c.collective == ALL_GATHER and (in_backward if c.backward else not step.gathered):
                    _add(totals, ALL_GATHER, c.group_size, gathered, k)
                elif c.collective == REDUCE_SCATTER and reduced and step.sync:
                    _add(totals, REDUCE_SCATTER, c.group_size, reduced, k)
                    # HSDP: each rank's padded 1/N output (ceil(d0 / N) rows of each) across the replicas
                    shard = sum(fsdp2_rules.shard_numel(p.dim0, p.numel, n) * reduce_elem for p in trained)
                    _add(totals, ALL_REDUCE, replicas, shard, k)
        for p in scalar_params:  # their hook all-reduces after every backward (execute/apply.py)
            if p.dtype in FLOAT_DTYPES and p.trainable:
                for group_size in ((n, replicas) if replicas > 1 else (n,)):
                    _add(totals, ALL_REDUCE, group_size, p.numel * dtype_bytes(numerics.sharded_dtype(p.dtype)), k)
    return tuple(CollectiveBytes(c, g, calls, nbytes) for (c, g), (calls, nbytes) in sorted(totals.items()))
