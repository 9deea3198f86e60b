"""FSDP2's per-unit rules, each written once: the one place every stage asks.

Three rules of torch 2.13's FSDP2 (torch/distributed/fsdp/_fully_shard/) that several stages need. Each
is one function here, and no other module writes it again: the cost model (its step's events,
cost/schedule.py; the per-unit collectives, cost/unit_collectives.py; the bytes, cost/unit_bytes.py and
cost/comm_bytes.py; the HSDP all-reduce, cost/collectives.py), the solver's linear model
(solve/linear.py), the executor (execute/apply.py) and the FSDP2 export (report/export/fsdp2.py, whose
generated file imports only torch and so writes the prefetch slicing out; tests/report/test_export_rules.py
checks it against :func:`explicit_prefetch`). What ``reshard_after_forward`` means is cost/reshard.py's
(:class:`ReshardAfterForward`); which collectives each meaning issues is here.

[Note: Dim-0 padding]
FSDP2 shards every parameter on dim 0 over the N ranks of the shard group with ``torch.chunk`` semantics
and pads every rank's shard to the first chunk's size (``FSDPParam._init_sharded_param``, _fsdp_param.py:
``chunks = _chunk_with_empty(param_data, shard_world_size, dim=shard_dim)``, ``padded_sharded_size =
chunks[0].size()  # 0th always padded``; ``_chunk_with_empty`` in _fsdp_common.py is ``torch.chunk``
plus empty chunks). ``torch.chunk`` makes chunks of ceil(d0 / N) rows, so each rank holds
ceil(d0 / N) rows (:func:`shard_rows`), and the all-gather output and the reduce-scatter input of a
parameter of shape (d0, ...) hold ceil(d0 / N) x N rows (``_get_dim0_padded_size``, _fsdp_common.py:
``math.ceil(tensor_size[0] / dim0_factor) * dim0_factor``): :func:`padded_numel`. The 1/N of such a
padded flat buffer — a reduce-scatter's output, the HSDP all-reduce's message — is :func:`shard_bytes`.
The unsharded parameters are views of the padded all-gather output (``FSDPParam.init_unsharded_param``),
the sharded gradient a view of the padded reduce-scatter output, so rank 0 (the largest shard) holds
ceil(dim0 / N) rows of each. cost/unit_bytes.py pads every tensor whose shape the trace recorded
(``ModuleTrace.sharded_param_shapes``); hand-written and older traces have none and stay unpadded.
A tensor with dim 0 of 1 (ViT's ``pos_embed``) is whole on every rank.

[Note: Prefetch depth and targets]
An explicit prefetch depth k sets, on each unit, the list of the next k units of its order
(``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``): :func:`explicit_prefetch`,
what the executor and the export set. What runs is more: FSDP2's implicit forward prefetch (the CPU runs
ahead and issues the next unit's all-gather while this one computes) overlaps one unit even at k = 0, and
in backward a unit whose explicit list is empty prefetches the next one (``FSDPState._pre_backward``;
the root always: the executor sets no list on it), so both depths are effectively max(1, k):
:func:`effective_prefetch_depth`, and the units a pre-backward gathers early are
:func:`backward_prefetch_targets`.

[Note: The collectives of each reshard policy]
Per unit and step FSDP2 issues an all-gather over the shard group before forward (from the sharded
state), a reduce-scatter of the gradients over the shard group after backward, and in backward one more
all-gather when the unit resharded after forward: over the shard group from the sharded state (ALWAYS,
``True``), over the r ranks of the 1/r post-forward shards (TO_GROUP, an int r:
``_all_gather_process_group`` is the post-forward mesh's), none when it kept its parameters (NEVER,
``False``; the root's ``None``): :func:`unit_collectives_of`. ALWAYS and TO_GROUP both issue three, NEVER
two. The HSDP all-reduce of the 1/N output across the replicas follows each reduce-scatter
(``foreach_reduce``); it depends on the mesh, not on the policy.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

from shard_planner.plan.comm import ALL_GATHER, REDUCE_SCATTER
from shard_planner.cost.reshard import Reshard, ReshardAfterForward


# ---- [Note: Dim-0 padding] ----
def shard_rows(dim0: int, shard_group_size: int) -> int:
    """Rows of dim 0 each rank holds of a parameter with ``dim0`` rows: the first ``torch.chunk`` chunk's,
    ceil(dim0 / N), to which FSDP2 pads every rank's shard. See [Note: Dim-0 padding]."""
    return math.ceil(dim0 / shard_group_size)


def shard_numel(dim0: int, numel: int, shard_group_size: int) -> int:
    """Elements of one rank's padded shard of a parameter of ``numel`` elements and ``dim0`` rows:
    :func:`shard_rows` rows. See [Note: Dim-0 padding]."""
    if dim0 == 0:
        return 0
    return shard_rows(dim0, shard_group_size) * (numel // dim0)


def padded_numel(dim0: int, numel: int, shard_group_size: int) -> int:
    """Elements of the all-gather output / reduce-scatter input of that parameter: dim 0 padded to
    ceil(dim0 / N) x N rows (``_get_dim0_padded_size``), N x :func:`shard_numel`. See [Note: Dim-0
    padding]."""
    return shard_numel(dim0, numel, shard_group_size) * shard_group_size


def shard_bytes(full_bytes: float, shard_group_size: int) -> float:
    """One rank's 1/N of a flat buffer of ``full_bytes`` sharded over N ranks (a reduce-scatter's output;
    the HSDP all-reduce's message): exact for a padded buffer (:func:`padded_numel`). See [Note: Dim-0
    padding]."""
    return full_bytes / shard_group_size


# ---- [Note: Prefetch depth and targets] ----
def effective_prefetch_depth(depth: int) -> int:
    """Units ahead that FSDP2 gathers at an explicit prefetch ``depth`` (forward or backward): max(1, k),
    its implicit forward prefetch and its default backward prefetch giving one at k = 0. See [Note:
    Prefetch depth and targets]."""
    return max(1, depth)


def explicit_prefetch(order, position: int, depth: int) -> tuple:
    """The explicit prefetch list of ``order[position]``: the next ``depth`` units of ``order`` (what
    ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` is given; empty at depth
    0 and for the last unit). See [Note: Prefetch depth and targets]."""
    return tuple(order[position + 1: position + 1 + depth])


def backward_prefetch_targets(backward_units, position: int, prefetch_backward: int) -> tuple:
    """The units the pre-backward of ``backward_units[position]`` prefetches, ``backward_units`` in
    pre-backward order with the root first: the root the next one (FSDP2's default: the executor sets no
    list on it), every other unit the next max(1, ``prefetch_backward``) (:func:`effective_prefetch_depth`).
    See [Note: Prefetch depth and targets]."""
    depth = 1 if position == 0 else effective_prefetch_depth(prefetch_backward)
    return explicit_prefetch(backward_units, position, depth)


# ---- [Note: The collectives of each reshard policy] ----
class UnitCollective(NamedTuple):
    """One collective FSDP2 issues for a unit in one step (see [Note: The collectives of each reshard
    policy])."""

    collective: str  # ALL_GATHER or REDUCE_SCATTER (shard_planner.plan.comm)
    backward: bool  # issued in backward (the backward all-gather, the reduce-scatter)
    group_size: int  # ranks of its group: the shard group, or r for TO_GROUP's backward all-gather
    from_sharded: bool  # an all-gather from the sharded state (under CPU offload: a host-to-device copy first)


@lru_cache(maxsize=None)
def unit_collectives_of(reshard: ReshardAfterForward, shard_group_size: int) -> tuple[UnitCollective, ...]:
    """The all-gathers and the reduce-scatter of one unit with ``reshard`` after forward over a shard
    group of ``shard_group_size`` ranks, in the order they run. See [Note: The collectives of each
    reshard policy]."""
    forward = UnitCollective(ALL_GATHER, False, shard_group_size, True)
    reduce = UnitCollective(REDUCE_SCATTER, True, shard_group_size, False)
    if reshard.kind is Reshard.NEVER:
        return forward, reduce
    regather = UnitCollective(ALL_GATHER, True, reshard.group_size, reshard.kind is Reshard.ALWAYS)
    return forward, regather, reduce


def backward_all_gather(reshard: ReshardAfterForward, shard_group_size: int) -> UnitCollective | None:
    """The backward all-gather of :func:`unit_collectives_of` (None: the unit keeps its parameters)."""
    return next((c for c in unit_collectives_of(reshard, shard_group_size)
                 if c.collective == ALL_GATHER and c.backward), None)


def all_gathers_per_step(reshard: ReshardAfterForward, shard_group_size: int) -> int:
    """How many all-gathers (and so FSDP2 copy-outs, cost/fsdp_copies.py) a unit with ``reshard`` issues
    per step."""
    return sum(c.collective == ALL_GATHER for c in unit_collectives_of(reshard, shard_group_size))
