"""What one unit's collectives cost in one step: the per-unit rule that the per-unit cost query
(cost/unit_cost.py) calls for the two-stream time walk (cost/time.py ``unit_collectives_s``) and the
solver's linear model (solve/linear.py ``_exposed_comm_s``) alike, so FSDP2's collective schedule per
unit is written once.

FSDP2 (torch 2.13, torch/distributed/fsdp/_fully_shard/) issues per unit: an all-gather of its
unsharded parameters over the shard group before its forward; another before its backward when it
resharded after forward — over the shard group (True) or over the ``r`` ranks it resharded to (an int);
none when it kept them (False) — (cost/reshard.py, one meaning of ``reshard_after_forward``;
cost/fsdp2_rules.py, the collectives of each: [Note: The collectives of each reshard policy]); a
reduce-scatter of its gradients over the shard group after its backward and, under HSDP, an all-reduce
of the 1/N output across the replicas (``foreach_reduce``). Under CPU offload the sharded parameters are
copied host-to-device before every all-gather from the sharded state and the sharded gradients back
after the reduce-scatter (PCIe at the profile's ``host_to_device_bytes_per_s``). Each collective is
priced by cost/collectives.py's ring model.

[Note: The per-unit collective rule and its byte inputs]
:func:`unit_collectives` takes the bytes as inputs; its one caller, cost/unit_cost.py's ``unit_cost``,
passes the unit's ``UnitBytes`` (``unsharded``: floating parameters in the param dtype plus the
non-floating ones as built; ``rs_input``; under offload ``sharded`` and ``sharded_grad``), for the time
walk's units (from the cost tables) and the linear model's candidate units (from their items'
parameters, solve/item_params.py) alike. The linear model then departs from it in two stated
approximations (solve/linear.py's docstring): it prices the host copies under offload once per step as
a constant (every parameter's shard in and its gradient out) instead of per all-gather, and the modules
that join the root unit by the bandwidth term alone (``ring_bandwidth_s``). Everything else — which
all-gathers run, over which group, the HSDP all-reduce — is this function's, for both.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.cost.collectives import all_gather_time_s, reduce_scatter_time_s, replica_all_reduce_time_s
from shard_planner.cost import fsdp2_rules  # called through the module: a test changes a rule, every caller follows
from shard_planner.cost.reshard import ReshardAfterForward
from shard_planner.parallel.mesh import Mesh


@dataclass(frozen=True, slots=True)
class UnitCollectives:
    """One unit's communication in one step (seconds on one rank), each collective apart so that a
    caller sums them in its own order; see the module docstring."""

    all_gather_fwd_s: float  # the forward all-gather over the shard group
    all_gather_bwd_s: float  # the backward all-gather (over the reshard group); 0 when it kept its parameters
    reduce_scatter_s: float  # the gradients' reduce-scatter over the shard group
    replica_all_reduce_s: float  # HSDP: the all-reduce of its 1/N output across the replicas; 0 without
    copy_in_fwd_s: float  # CPU offload: the sharded parameters host-to-device before the forward all-gather
    copy_in_bwd_s: float  # the same before the backward one, when it gathers from the sharded state again
    copy_back_s: float  # CPU offload: the sharded gradients device-to-host after the reduction

    @property
    def forward_s(self) -> float:
        """Before the unit's forward can run: the copy-in (offload) and the all-gather."""
        return self.all_gather_fwd_s + self.copy_in_fwd_s

    @property
    def backward_s(self) -> float:
        """Before the unit's backward can run: the copy-in (offload, resharded to the shard group) and the
        all-gather; 0 when it kept its parameters."""
        return self.all_gather_bwd_s + self.copy_in_bwd_s

    @property
    def reduction_s(self) -> float:
        """After the unit's backward: the reduce-scatter, the HSDP all-reduce and the copy back (offload)."""
        return self.reduce_scatter_s + self.replica_all_reduce_s + self.copy_back_s


def unit_collectives(profile, reshard: ReshardAfterForward, mesh: Mesh, all_gather_bytes: float,
                     reduce_scatter_bytes: float, host_copy_in_bytes: float = 0.0,
                     host_copy_back_bytes: float = 0.0) -> UnitCollectives:
    """The collectives of one unit that all-gathers ``all_gather_bytes`` (the unsharded size) and
    reduce-scatters ``reduce_scatter_bytes`` (the full input) with ``reshard`` after forward over the groups
    of the layout ``mesh``; under CPU offload it copies ``host_copy_in_bytes`` in before each all-gather from
    the sharded state and ``host_copy_back_bytes`` back (0: no offload). [Note: The per-unit collective rule and its byte inputs]"""
    ag_fwd = all_gather_time_s(profile, all_gather_bytes, mesh)
    # which all-gather runs in backward, over which group: cost/fsdp2_rules.py [Note: The collectives of
    # each reshard policy] (none when the unit kept its parameters)
    bwd = fsdp2_rules.backward_all_gather(reshard, mesh.shard_group_size)
    if bwd is None:
        ag_bwd = 0.0
    elif bwd.group_size == mesh.shard_group_size:  # from the sharded state again, over the shard group
        ag_bwd = ag_fwd
    else:  # from the 1/r post-forward shards, over the r ranks of its node (cost/reshard.py)
        ag_bwd = all_gather_time_s(profile, all_gather_bytes, mesh, bwd.group_size)
    h2d = profile.host_to_device_bytes_per_s
    copy_in = host_copy_in_bytes / h2d if host_copy_in_bytes else 0.0
    return UnitCollectives(
        all_gather_fwd_s=ag_fwd, all_gather_bwd_s=ag_bwd,
        reduce_scatter_s=reduce_scatter_time_s(profile, reduce_scatter_bytes, mesh),
        replica_all_reduce_s=replica_all_reduce_time_s(profile, reduce_scatter_bytes, mesh),
        copy_in_fwd_s=copy_in, copy_in_bwd_s=copy_in if bwd is not None and bwd.from_sharded else 0.0,
        copy_back_s=host_copy_back_bytes / h2d if host_copy_back_bytes else 0.0,
    )
