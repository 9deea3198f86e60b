"""Per-unit byte sizes under one plan: what the memory and the time simulators both read.

Sharded, unsharded (all-gathered), reduce-scatter input and output, the mixed-precision cast copy and
the reshard-to-a-group clone of one unit (:func:`unit_bytes_of`), from its parameters
(cost/unit_params.py) and the plan's mesh and dtypes, each tensor's dim 0 padded to a multiple of the
shard group as FSDP2 pads it where the trace knows its shape (cost/fsdp2_rules.py [Note: Dim-0
padding]); the per-unit cost query (cost/unit_cost.py) and the memory walk (every unit of a plan:
:func:`query_unit_bytes`) ask it. The buffers themselves are
explained in cost/memory.py's notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from shard_planner.cost import fsdp2_rules  # called through the module: a test changes a rule, every caller follows
from shard_planner.cost.queries import UnitBytesQuery
from shard_planner.cost.reshard import ReshardAfterForward
from shard_planner.cost.tables import CostTables
from shard_planner.cost.unit_params import UnitParams
from shard_planner.dtypes import FLOAT_DTYPES, dtype_bytes
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.plan.numerics import Numerics


@dataclass(frozen=True, slots=True)
class UnitBytes:
    """One unit's byte sizes under one plan (bytes on one rank)."""

    sharded: float  # its sharded parameters (+ non-floating ones), 1/N of them padded; its 0-d parameters whole
    unsharded: float  # the unsharded parameters (copied out of the all-gather output), in the param dtype
    # the flat all-gather output: the same bytes while the all-gather runs in the param dtype; another size
    # where it does not (float8 and NF4 all-gathers): its own allocation kind (cost/allocations.py)
    all_gather_output: float
    rs_input: float  # reduce-scatter input, in the reduce dtype
    rs_output: float  # its 1/N output
    sharded_grad: float  # the sharded gradient of its trainable parameters, in the built dtype (0-d ones' whole)
    cast_input: float  # mixed precision: the flat param-dtype copy of the all-gather input (1/N)
    post_forward: float  # reshard_after_forward=r: the 1/r clone kept after forward (0 otherwise)
    reshard: bool  # reshards after forward (True or an int)
    grad_cast: bool  # the reduce dtype differs from the built dtype: a cast after the reduce-scatter
    last_grad: float  # the gradient autograd produces last for the unit ([Note: Reduce-scatter buffers])
    mp: bool  # mixed precision applies (some floating parameter's dtype differs from the param dtype)
    unsharded_grads: float  # every unsharded gradient of its trainable parameters, in the param dtype


def reduce_scatter_backend_temp_bytes(rs_input_bytes: float, profile: HardwareProfile, shard_group_size: int) -> float:
    """The backend's temporary during a reduce-scatter of ``rs_input_bytes`` over ``shard_group_size`` ranks: gloo
    copies the input, NCCL allocates none (the profile's ``reduce_scatter_temp_fraction``; cost/memory.py
    [Note: Reduce-scatter buffers]); none on one rank, where ``foreach_reduce`` copies the input to the output
    and calls no collective (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, ``world_size > 1``).
    Measured: examples/vit.py at micro-batch 1 on one CPU rank, FSDP2 one root unit, 4.10 MiB; predicted
    4.92 MiB (+20%) before, 4.10 MiB after."""
    if shard_group_size == 1:
        return 0.0
    return rs_input_bytes * profile.reduce_scatter_temp_fraction


def query_unit_bytes(t: CostTables, q: UnitBytesQuery) -> tuple[UnitBytes, ...]:
    """The byte sizes of every unit of ``q`` (segmented as ``t``); reads only ``q``
    (cost/queries.py [Note: A memo is keyed by its function's query])."""
    return tuple(unit_bytes_of(p, u.reshard_after_forward, q.shard_group_size, q.numerics)
                 for p, u in zip(t.unit_params, q.units))


def unit_bytes_of(p: UnitParams, reshard_after_forward: bool | int | None, shard_group_size: int,
                  numerics: Numerics) -> UnitBytes:
    """The byte sizes of one unit that owns ``p``, under FSDP2 with that ``reshard_after_forward`` over a
    shard group of ``shard_group_size`` ranks and the dtypes of ``numerics`` (cost/memory.py's notes say which
    buffer is which)."""
    n = shard_group_size
    # Floating parameters are gathered, and their gradients computed, in the compute dtype whatever they are
    # stored in (Numerics.gathered_dtype); gradients are reduce-scattered in its reduce dtype.
    pd_elem, rs_elem = dtype_bytes(numerics.compute_dtype), dtype_bytes(numerics.reduce_scatter_dtype)
    mp = any(numerics.casts(dt) for dt in p.float_dtypes)  # mixed precision: a cast copy before the all-gather
    # dim 0 padded to ceil(dim0 / N) x N rows: the all-gather output (of which the unsharded parameters are
    # views), the reduce-scatter input, and each rank's shard, ceil(dim0 / N) rows (rank 0's, the largest)
    pad = _padding(p, n)
    unsharded = (p.float_numel + pad.float_numel) * pd_elem + p.other_bytes + pad.other_bytes
    # Gradients, their reduce-scatter and the optimizer's states exist for trainable parameters only; the
    # all-gather and the parameters for all of them (cost/unit_params.py [Note: Frozen parameters in a unit]).
    # A reduce dtype equal to the compute dtype means "no cast" (FSDPParam.init_dtype_attrs): same bytes.
    rs_input = (p.trainable_float_numel + pad.trainable_float_numel) * rs_elem
    rs_output = fsdp2_rules.shard_bytes(rs_input, n)  # its 1/N output (cost/fsdp2_rules.py)
    sharded_grad = fsdp2_rules.shard_bytes(p.trainable_float_built_bytes + pad.trainable_float_built_bytes,
                                           n)
    r = ReshardAfterForward.of(reshard_after_forward, n)
    # 0-d parameters are replicated, not sharded: whole on every rank, with their whole gradient (in the
    # built dtype, all-reduced) and so their whole optimizer states; never gathered or reduce-scattered.
    # See [Note: 0-d parameters] in execute/apply.py.
    return UnitBytes(
        sharded=fsdp2_rules.shard_bytes(p.float_built_bytes + p.other_bytes + pad.float_built_bytes
                                        + pad.other_bytes, n) + p.replicated_bytes,
        unsharded=unsharded, all_gather_output=unsharded, rs_input=rs_input, rs_output=rs_output,
        sharded_grad=sharded_grad + p.replicated_float_bytes,
        cast_input=fsdp2_rules.shard_bytes(unsharded, n) if mp else 0.0,
        post_forward=r.clone_bytes(unsharded), reshard=r.reshards,
        grad_cast=rs_output != sharded_grad,  # reduce dtype differs from built: cast after
        last_grad=p.first_float_numel * pd_elem, mp=mp, unsharded_grads=p.trainable_float_numel * pd_elem,
    )


class _Padding(NamedTuple):
    """What dim-0 padding adds to a unit's parameters over N ranks (all N shards together)."""

    float_numel: int = 0  # floating elements (gathered in the param dtype)
    float_built_bytes: int = 0  # their bytes as built
    other_bytes: int = 0  # non-floating parameters' bytes
    trainable_float_numel: int = 0  # of the floating elements, those that train
    trainable_float_built_bytes: int = 0


_NO_PADDING = _Padding()


def _padding(p: UnitParams, n: int) -> _Padding:
    """The rows FSDP2 pads ``p``'s tensors with over ``n`` ranks (cost/fsdp2_rules.py ``padded_numel``): 0
    for a unit whose shapes the trace does not know, or none of whose dim 0 sizes leaves a remainder."""
    return _padding_of(p.sharded_shapes, n) if p.sharded_shapes else _NO_PADDING


@lru_cache(maxsize=4096)  # the planner asks for the same units' bytes at every choice of one mesh
def _padding_of(sharded_shapes: tuple, n: int) -> _Padding:
    out = [0, 0, 0, 0, 0]
    for dim0, numel, dtype, trainable in sharded_shapes:
        extra = fsdp2_rules.padded_numel(dim0, numel, n) - numel
        if not extra:
            continue
        nbytes = extra * dtype_bytes(dtype)
        if dtype not in FLOAT_DTYPES:
            out[2] += nbytes
            continue
        out[0] += extra
        out[1] += nbytes
        if trainable:
            out[3] += extra
            out[4] += nbytes
    return _Padding(*out) if any(out) else _NO_PADDING
