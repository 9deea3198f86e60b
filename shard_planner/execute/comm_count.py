"""Count the bytes one rank's collectives move during the measured steps of a run.

FSDP2 (torch 2.13) issues its collectives through ``torch.distributed``'s module attributes at call time
(``dist.all_gather_single`` and ``dist.reduce_scatter_single`` in ``_fsdp_collectives.py``,
``dist.all_reduce`` for HSDP; apply_plan's 0-d parameters use ``dist.all_reduce`` too). While a
:class:`CommCounter` is active these attributes are wrapped: each call adds one collective and its
message size (the full all-gather output, the full reduce-scatter input, the all-reduce buffer: the
sizes cost/comm_bytes.py predicts) under (collective, group size). Calls nested inside another counted
call (an API implemented by another) count once, at the outermost. Collectives over a group of one
rank are not counted (nothing moves).

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

from shard_planner.comm import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CollectiveBytes
from shard_planner.cost.comm_bytes import ParamShape
from shard_planner.ownership import innermost_unit
from shard_planner.param_storage import stored_parts
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


class CommCounter:
    """Counts collectives while active (``with counter:``); ``take()`` returns and resets the counts."""

    def __init__(self):
        self._counts: dict[tuple[str, int], list[int]] = {}
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
                    entry = self._counts.setdefault((collective, size), [0, 0])
                    entry[0] += 1
                    entry[1] += _nbytes(tensor)
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

    def take(self) -> tuple[CollectiveBytes, ...]:
        """The counts since the last ``take`` (sorted as the prediction is), and start again."""
        out = tuple(CollectiveBytes(c, g, calls, nbytes) for (c, g), (calls, nbytes) in sorted(self._counts.items()))
        self._counts = {}
        return out


def unit_param_shapes(model: nn.Module, plan: Plan) -> tuple[tuple[tuple[ParamShape, ...], ...], tuple[ParamShape, ...]]:
    """(per plan unit, the shapes of the parameters it will shard; the 0-d parameters), read from the
    unsharded ``model``: each Parameter (once, tied ones at their first registration) belongs to the
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
