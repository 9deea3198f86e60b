"""What one FSDP unit costs in one step of one plan: the per-unit query every stage asks.

:func:`unit_cost` answers, for a unit that owns some parameters (cost/unit_params.py) under one plan's
setting (cost/queries.py ``UnitSetting``: the mesh, the dtypes, the optimizer, CPU offload) and its own
``reshard_after_forward``:

- its bytes by kind (cost/unit_bytes.py ``unit_bytes_of``: sharded state, all-gather output, unsharded
  parameters and gradients, reduce-scatter buffers, the cast copy and the post-forward clone);
- its collectives' seconds (cost/unit_collectives.py ``unit_collectives``: which all-gathers run, over
  which group, the reduce-scatter, HSDP's all-reduce, the host copies under offload);
- FSDP2's copies on the compute stream (cost/fsdp_copies.py ``copies_s``);
- its sharded model state: the optimizer's states over its sharded gradients and where they live
  (cost/optimizer.py).

Who asks: the memory walk reads the bytes (cost/model.py ``unit_bytes``: the bytes' memo is shared by
every profile and rank count, the collectives' is not), the two-stream time walk the collectives and
the copies (cost/model.py ``unit_costs``), and the solver's linear model all of it, per candidate unit
(solve/linear.py). So each FSDP2 rule a unit's cost follows — what ``reshard_after_forward`` means, which
buffers exist and their sizes, which collectives run over which group, the offload test, the optimizer
states — is written once, in the module named beside it above (FSDP2's per-unit rules those modules call —
the padded 1/N shard, the collectives of each reshard policy — in cost/fsdp2_rules.py); tests/solve/test_linear_follows_cost_rules.py
changes one and sees the simulators and the linear model follow. Compute is priced per block of modules,
not per unit (cost/model.py ``module_compute_s`` for the linear model's items, ``block_compute_s`` for
the simulators' blocks, both from one :func:`shard_planner.cost.kernels` price per module).
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.cost import optimizer as optimizer_rules
from shard_planner.cost import unit_bytes as unit_bytes_rules
from shard_planner.cost import unit_collectives as collective_rules
from shard_planner.cost.fsdp_copies import copies_s, copy_bandwidth_bytes_per_s
from shard_planner.cost.queries import UnitSetting
from shard_planner.cost.reshard import ReshardAfterForward
from shard_planner.cost.unit_bytes import UnitBytes
from shard_planner.cost.unit_collectives import UnitCollectives
from shard_planner.cost.unit_params import UnitParams
from shard_planner.hardware.profile import HardwareProfile


@dataclass(frozen=True, slots=True)
class UnitCost:
    """One unit's cost in one step on one rank: see the module docstring."""

    bytes: UnitBytes
    collectives: UnitCollectives
    copy_out_s: float  # one all-gather's copy-out on the compute stream (0 where not priced)
    copy_in_s: float  # the reduce-scatter's copy-in on the compute stream
    state_on_device: bool  # its sharded parameters, gradients and optimizer states are in device memory
    optimizer_state_bytes: float  # the optimizer's states of its sharded gradients (wherever they live)

    @property
    def sharded_state_bytes(self) -> float:
        """Sharded parameters, their gradients and the optimizer's states (ZeRO §5's 2 + 2 + K per
        element at stage 3, here as built): in device memory unless CPU offload moved them to the host."""
        x = self.bytes
        return x.sharded + x.sharded_grad + self.optimizer_state_bytes if self.state_on_device else 0.0


def unit_cost(params: UnitParams, reshard_after_forward: bool | int | None, setting: UnitSetting,
              profile: HardwareProfile) -> UnitCost:
    """What the unit that owns ``params`` costs under ``setting`` with that ``reshard_after_forward``
    on ``profile`` (the module docstring)."""
    mesh = setting.mesh
    n = mesh.shard_group_size
    # the rules are called through their modules, so that a test that changes one sees every caller follow
    x = unit_bytes_rules.unit_bytes_of(params, reshard_after_forward, n, setting.numerics)
    offload = setting.cpu_offload
    coll = collective_rules.unit_collectives(
        profile, ReshardAfterForward.of(reshard_after_forward, n), mesh, x.unsharded,
        x.rs_input, x.sharded if offload else 0.0, x.sharded_grad if offload else 0.0)
    bw = copy_bandwidth_bytes_per_s(profile)
    copy_out, copy_in = copies_s(x.unsharded, x.rs_input, bw) if bw > 0.0 else (0.0, 0.0)
    return UnitCost(bytes=x, collectives=coll, copy_out_s=copy_out, copy_in_s=copy_in,
                    state_on_device=optimizer_rules.state_on_device(offload, profile.device),
                    optimizer_state_bytes=optimizer_rules.optimizer_state_bytes(setting.optimizer, x.sharded_grad))
