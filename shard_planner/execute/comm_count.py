"""Count the bytes one rank's collectives move during the measured steps of a run.

FSDP2 (torch 2.13) issues its collectives through ``torch.distributed``'s module attributes at call time
(``dist.all_gather_single`` and ``dist.reduce_scatter_single`` in ``_fsdp_collectives.py``,
``dist.all_reduce`` for HSDP; apply_plan's 0-d parameters use ``dist.all_reduce`` too). While a
:class:`CommCounter` is active these attributes are wrapped: each call adds one collective and its
message size (the full all-gather output, the full reduce-scatter input, the all-reduce buffer: the
sizes cost/comm_bytes.py predicts) under (collective, group size), and under the process group's name
in the device mesh (:func:`group_roles`). Calls nested inside another counted call (an API implemented by
another) count once, at the outermost. Collectives over a group of one rank are not counted (nothing moves).

[Note: counting tensor parallelism's collectives]
DTensor (tensor parallelism's redistributions, loss parallelism's reductions, a replicated norm weight's
gradient) issues functional collectives: the dispatcher ops ``torch.ops._c10d_functional.*``, reached from many
Python entry points (``funcol.all_gather_single``, ``reduce_scatter_single``, ``all_reduce`` in
torch/distributed/tensor/placement_types.py and parallel/loss.py:209-214, ``shard_dim_alltoall`` in
_collective_utils.py), which call the process group in C++, never ``torch.distributed``'s Python functions.
:class:`FunctionalCollectiveCounter` is a TorchDispatchMode that sees those ops, as torch's CommDebugMode does
(torch/distributed/tensor/debug/_comm_mode.py:642-704: a DTensor op is handed back with NotImplemented, so that
DTensor desugars it into local ops and collectives, which the mode then sees), and counts each with its bytes
under its group (the op's last argument, a group name). The two counters never see the same call: FSDP2's go
through Python and the c10d ops (``c10d._allgather_base_``), DTensor's through ``_c10d_functional``.
What is counted is what the program issues: the collective called and its message size, not what the
backend does for it. gloo implements reduce-scatter with an all-reduce underneath (torch's
torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, C++ that the wheel does not ship, so not cited by line here),
so on CPU the bytes on the wire differ from the counted ones; NCCL runs the reduce-scatter itself. The mode costs a Python call per operator, so it runs only in a run with tensor
parallelism (the step times of runs without it are as before).

Why not torch's CommDebugMode (torch.distributed.tensor.debug): on torch 2.13 it does see FSDP2's c10d
collectives (checked on CPU/gloo at 2 ranks: a model of two units counts 4 ``c10d._allgather_base_`` and 2
``c10d._reduce_scatter_base_`` per step), but it counts calls per operator, not bytes per process group,
which the comparison with the prediction needs.

:func:`unit_param_shapes` reads, from the model before sharding, the shapes of the parameters each plan
unit will own: the other input of the prediction.
"""

from __future__ import annotations

import functools
import logging
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _get_group_size_by_name, _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from shard_planner.plan.comm import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, FSDP, REDUCE_SCATTER, TP,
                                CollectiveBytes, GroupCollectiveBytes)
from shard_planner.cost.comm_bytes import ParamShape
from shard_planner.plan.ownership import innermost_unit
from shard_planner.model.param_storage import stored_parts
from shard_planner.plan import Plan

logger = logging.getLogger(__name__)

# torch.distributed function -> (collective, which argument holds the message: name, position)
_WRAPPED = {
    "all_gather_single": (ALL_GATHER, "output_tensor", 0),
    "all_gather_into_tensor": (ALL_GATHER, "output_tensor", 0),
    "reduce_scatter_single": (REDUCE_SCATTER, "input", 1),
    "reduce_scatter_tensor": (REDUCE_SCATTER, "input", 1),
    "all_reduce": (ALL_REDUCE, "tensor", 0),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


WORLD = "world"


def group_roles(mesh: DeviceMesh | None) -> dict[str, str]:
    """Process group name -> what it is in ``mesh``: its dimension's name ("shard", "replicate", "tp"), or
    "world" for the default group (when no dimension is the whole world)."""
    roles = {}
    if mesh is not None and mesh.mesh_dim_names:
        for name in mesh.mesh_dim_names:
            roles.setdefault(mesh.get_group(name).group_name, name)
    if dist.is_initialized():
        roles.setdefault(dist.group.WORLD.group_name, WORLD)
    return roles


def rank_roles(mesh: DeviceMesh | None) -> dict[frozenset[int], str]:
    """This rank's group of each dimension of ``mesh``, by its ranks -> the dimension's name.

    [Note: a group named by its ranks]
      DTensor may run a collective over a group that is not this mesh's, of the same ranks. Seen on CPU/gloo
      (tests/execute/test_tp_predicted.py): several plans in one process (``run_plans``) build a mesh each, and
      the second of two 2 x 2 plans issued every tensor-parallel all-reduce over a group of its tp ranks whose
      name none of its mesh's groups has. Likely an earlier plan's mesh reached through a cache of DTensor's
      (its sharding propagation caches specs, whose meshes compare equal by ranks and layout): not confirmed.
      The ranks are this rank's tp group's, so the collective is named by the dimension whose group holds them.
    """
    if mesh is None or not mesh.mesh_dim_names:
        return {}
    out: dict[frozenset[int], str] = {}
    for name in mesh.mesh_dim_names:
        out.setdefault(frozenset(dist.get_process_group_ranks(mesh.get_group(name))), name)
    return out


def _role(roles: dict[str, str], by_ranks: dict[frozenset[int], str], group_name: str, size: int) -> str:
    """The group's name in the mesh ([Note: a group named by its ranks]); "N ranks" for a group of no mesh
    dimension (FSDP2's group of an int ``reshard_after_forward``)."""
    if group_name in roles:
        return roles[group_name]
    if by_ranks:
        ranks = frozenset(dist.get_process_group_ranks(_resolve_process_group(group_name)))
        if ranks in by_ranks:
            return by_ranks[ranks]
    return f"{size} ranks"


class _Tally:
    """(source, group, collective, group size) -> [calls, bytes]."""

    def __init__(self):
        self.counts: dict[tuple[str, str, str, int], list[int]] = {}

    def add(self, key: tuple[str, str, str, int], nbytes: int) -> None:
        entry = self.counts.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def take(self) -> tuple[GroupCollectiveBytes, ...]:
        out = tuple(GroupCollectiveBytes(*key, calls, nbytes) for key, (calls, nbytes) in sorted(self.counts.items()))
        self.counts = {}
        return out


class CommCounter:
    """Counts FSDP2's collectives while active (``with counter:``); ``take()`` returns and resets the counts.
    ``mesh``: names the groups (:func:`group_roles`) in :meth:`take_by_group`."""

    def __init__(self, mesh: DeviceMesh | None = None):
        self._tally = _Tally()
        self._roles, self._by_ranks = group_roles(mesh), rank_roles(mesh)
        self._depth = threading.local()
        self._originals: dict[str, object] = {}

    def _wrap(self, name: str, fn):
        collective, arg_name, position = _WRAPPED[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                tensor = kwargs.get(arg_name, args[position] if len(args) > position else None)
                group = kwargs.get("group", None)
                size = dist.get_world_size(group)
                if tensor is not None and size > 1:
                    pg = group if group is not None else dist.group.WORLD
                    role = _role(self._roles, self._by_ranks, pg.group_name, size)
                    self._tally.add((FSDP, role, collective, size), _nbytes(tensor))
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
        return counted

    def __enter__(self) -> "CommCounter":
        for name in _WRAPPED:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def take_by_group(self) -> tuple[GroupCollectiveBytes, ...]:
        """The counts since the last take, per group, and start again."""
        return self._tally.take()

    def take(self) -> tuple[CollectiveBytes, ...]:
        """The counts since the last take summed per (collective, group size) (sorted as the prediction is),
        and start again."""
        return by_group_size(self.take_by_group())


def by_group_size(counts) -> tuple[CollectiveBytes, ...]:
    """``counts`` (GroupCollectiveBytes) summed per (collective, group size), sorted as the prediction is."""
    sums: dict[tuple[str, int], list[int]] = {}
    for c in counts:
        entry = sums.setdefault((c.collective, c.group_size), [0, 0])
        entry[0] += c.calls
        entry[1] += c.bytes
    return tuple(CollectiveBytes(c, g, calls, nbytes) for (c, g), (calls, nbytes) in sorted(sums.items()))


def _tensors_nbytes(x) -> int:
    return sum(_nbytes(t) for t in x) if isinstance(x, (list, tuple)) else _nbytes(x)


# _c10d_functional op name -> (collective, message bytes from (first argument, group size)); the group name
# is every op's last argument (torch/csrc/distributed/c10d/Functional.cpp's schemas)
_FUNCTIONAL = {
    "all_gather_into_tensor": (ALL_GATHER, lambda x, n: _tensors_nbytes(x) * n),  # the whole output
    "all_gather_into_tensor_coalesced": (ALL_GATHER, lambda x, n: _tensors_nbytes(x) * n),
    "reduce_scatter_tensor": (REDUCE_SCATTER, lambda x, n: _tensors_nbytes(x)),  # the whole input
    "reduce_scatter_tensor_coalesced": (REDUCE_SCATTER, lambda x, n: _tensors_nbytes(x)),
    "all_reduce": (ALL_REDUCE, lambda x, n: _tensors_nbytes(x)),
    "all_reduce_": (ALL_REDUCE, lambda x, n: _tensors_nbytes(x)),
    "all_reduce_coalesced": (ALL_REDUCE, lambda x, n: _tensors_nbytes(x)),
    "all_reduce_coalesced_": (ALL_REDUCE, lambda x, n: _tensors_nbytes(x)),
    "all_to_all_single": (ALL_TO_ALL, lambda x, n: _tensors_nbytes(x)),
    "broadcast": (BROADCAST, lambda x, n: _tensors_nbytes(x)),
    "broadcast_": (BROADCAST, lambda x, n: _tensors_nbytes(x)),
}
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


class FunctionalCollectiveCounter(TorchDispatchMode):
    """Counts DTensor's functional collectives while active, per group of ``mesh``: see [Note: counting
    tensor parallelism's collectives]. ``take()`` returns and resets the counts."""

    def __init__(self, mesh: DeviceMesh | None = None):
        super().__init__()
        self._tally = _Tally()
        self._roles, self._by_ranks = group_roles(mesh), rank_roles(mesh)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns it into local ops and collectives, seen here next
        if func.namespace in _FUNCTIONAL_NAMESPACES and func._opname in _FUNCTIONAL:
            collective, message_bytes = _FUNCTIONAL[func._opname]
            group_name = args[-1] if args else kwargs["group_name"]
            size = _get_group_size_by_name(group_name)
            if size > 1:
                role = _role(self._roles, self._by_ranks, group_name, size)
                self._tally.add((TP, role, collective, size), message_bytes(args[0], size))
        return func(*args, **kwargs)

    def take(self) -> tuple[GroupCollectiveBytes, ...]:
        return self._tally.take()


def unit_param_shapes(model: nn.Module, plan: Plan) -> tuple[tuple[tuple[ParamShape, ...], ...], tuple[ParamShape, ...]]:
    """(per plan unit, the shapes of the parameters it will shard; the 0-d parameters), read from the
    unsharded ``model`` (with tensor parallelism: split by it, not yet sharded, so that a DTensor parameter's
    shape is its local tensor's, what FSDP2 shards over the data-parallel group): each Parameter (once, tied ones at their first registration) belongs to the
    innermost unit wrapping a module that registers it, as ``fully_shard`` assigns them."""
    unit_of = {fqn: i for i, u in enumerate(plan.units) for fqn in u.modules}
    per_unit: list[list[ParamShape]] = [[] for _ in plan.units]
    scalars: list[ParamShape] = []
    seen: set[int] = set()
    for fqn, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(p, DTensor):
                p = p.to_local()
            if p.dim() == 0:
                scalars.append(ParamShape(1, 1, str(p.dtype).removeprefix("torch."), p.requires_grad))
                continue
            i = innermost_unit(fqn, unit_of)
            if i is not None:  # what FSDP2 shards and gathers of it: an NF4 weight's packed codes and scalers
                per_unit[i].extend(ParamShape(part.dim0, part.numel, part.dtype, p.requires_grad)
                                   for part in stored_parts(p) if part.sharded)
    return tuple(tuple(ps) for ps in per_unit), tuple(scalars)


def units_with_backward(model: nn.Module, plan: Plan) -> tuple[bool, ...]:
    """Per plan unit, whether FSDP2 will run its pre-backward: some output of its module requires grad
    (docs/frozen_facts.md [Note: Pre-backward all-gather needs an output that requires grad]). Read from
    the unsharded ``model`` without running it: a module's output requires grad once a trainable
    parameter registered before its subtree ends has been used, taking registration order for forward
    order (true of the sequential models FSDP wraps; the cost model reads the traced fact instead,
    cost/tables.py ``unit_backward``). The root always does (the loss)."""
    first_trainable = None
    subtree_end: dict[str, int] = {}  # module -> the registration index its subtree ends at
    for i, (fqn, module) in enumerate(model.named_modules()):
        if first_trainable is None and any(p.requires_grad for p in module.parameters(recurse=False)):
            first_trainable = i
        parts = fqn.split(".") if fqn else []
        for k in range(len(parts) + 1):  # the module and each of its ancestors ("" the root)
            subtree_end[".".join(parts[:k])] = i
    return tuple(u.is_root or (first_trainable is not None
                               and any(first_trainable <= subtree_end.get(fqn, -1) for fqn in u.modules))
                 for u in plan.units)
