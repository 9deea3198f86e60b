"""What one FSDP unit's own parameters are, as every per-unit rule reads them.

A unit (``fully_shard`` of one or more modules) owns the parameters of its modules' subtrees that no
unit nested below it owns. The per-unit rules (cost/unit_cost.py: bytes by kind, collectives, FSDP2's
copies) need of them: the sharded parameters' elements by built dtype — floating ones are cast to the
param dtype, all-gathered and get gradients; others (integer, bool) are all-gathered as built and get
none —, the floating elements of its first module in forward order that holds parameters (their
gradient is the last autograd produces for the unit: cost/memory.py [Note: Reduce-scatter buffers]),
and its 0-d parameters, which FSDP2 cannot shard and the plan replicates (execute/apply.py [Note: 0-d
parameters]).

[Note: Frozen parameters in a unit]
FSDP2 (torch 2.13) all-gathers every parameter of a unit, frozen (``requires_grad`` False) or not, in
the param dtype where mixed precision casts it (docs/frozen_facts.md: [Note: Frozen parameters are
all-gathered], [Note: Mixed precision casts frozen parameters too]); it reduce-scatters only the
gradients that exist, and the optimizer keeps states only for parameters with a gradient ([Note:
Reduce-scatter of parameters with a gradient only]). So a unit's parameters are counted twice over:
all of them (``float_numel``, ``other_bytes``: the all-gather, the unsharded and sharded parameters) and
the trainable floating ones (``trainable_float_numel``: gradients, reduce-scatter, optimizer). A
non-floating parameter cannot require grad. A trace written before frozen parameters were recorded
loads with none frozen (trace/types.py), so there every floating parameter trains.

The cost tables (cost/tables.py) build one per unit of a segmentation; the solver's linear model
(solve/linear.py) one per candidate unit, by adding its items' (``+``): the same content, so the
simulators and the linear model size a unit by the same rule (issue 27).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shard_planner.dtypes import FLOAT_DTYPES, dtype_bytes


@dataclass(frozen=True, slots=True)
class UnitParams:
    """One unit's own parameters (bytes and elements on one rank before sharding, as built), and of them
    the trainable ones ([Note: Frozen parameters in a unit])."""

    numel_by_dtype: tuple[tuple[str, int], ...]  # sharded (not 0-d) parameters: (built dtype, elements)
    # the gradient autograd produces last for the unit: the trainable floating elements of its first module
    # in forward order that holds trainable floating parameters
    first_float_numel: int
    replicated_bytes: int = 0  # 0-d parameters, whole on every rank
    replicated_float_bytes: int = 0  # of those, the trainable floating ones (they get a whole gradient)
    trainable_numel_by_dtype: tuple[tuple[str, int], ...] = ()  # of numel_by_dtype, those that train
    # derived by ``of`` (the simulators' inner loops read them)
    float_numel: int = 0  # floating elements: cast to the param dtype and gathered, frozen or not
    float_built_bytes: int = 0  # their bytes as built
    other_bytes: int = 0  # non-floating parameters: gathered as built, no gradient, never cast
    float_dtypes: frozenset = frozenset()
    trainable_float_numel: int = 0  # floating elements that get gradients and optimizer states
    trainable_float_built_bytes: int = 0  # their bytes as built
    # of numel_by_dtype, the tensors whose dim-0 shapes the trace knows: (dim0, numel, dtype, trainable)
    # (trace/types.py ``ModuleTrace.sharded_param_shapes``; none in hand-written and older traces), those
    # of one (dim0, dtype, trainable) merged: their dim-0 padding is the same number of rows of each
    sharded_shapes: tuple[tuple[int, int, str, bool], ...] = ()

    @staticmethod
    def of(numel_by_dtype: dict[str, int], first_float_numel: int = 0, replicated_bytes: int = 0,
           replicated_float_bytes: int = 0, trainable_numel_by_dtype: dict[str, int] | None = None,
           sharded_shapes: tuple = ()) -> "UnitParams":
        """``trainable_numel_by_dtype`` None: every floating parameter trains."""
        floats = [(dt, k) for dt, k in numel_by_dtype.items() if dt in FLOAT_DTYPES]
        trainable = [(dt, k) for dt, k in (floats if trainable_numel_by_dtype is None
                                           else trainable_numel_by_dtype.items()) if dt in FLOAT_DTYPES and k]
        return UnitParams(
            numel_by_dtype=tuple(numel_by_dtype.items()), first_float_numel=first_float_numel,
            replicated_bytes=replicated_bytes, replicated_float_bytes=replicated_float_bytes,
            trainable_numel_by_dtype=tuple(trainable),
            float_numel=sum(k for _, k in floats), float_built_bytes=sum(k * dtype_bytes(dt) for dt, k in floats),
            other_bytes=sum(k * dtype_bytes(dt) for dt, k in numel_by_dtype.items() if dt not in FLOAT_DTYPES),
            float_dtypes=frozenset(dt for dt, _ in floats),
            trainable_float_numel=sum(k for _, k in trainable),
            trainable_float_built_bytes=sum(k * dtype_bytes(dt) for dt, k in trainable),
            sharded_shapes=_merged(sharded_shapes))

    @staticmethod
    def of_modules(modules: Iterable) -> "UnitParams":
        """The parameters registered on ``modules`` (trace ModuleTraces), in the order given: the first
        that holds trainable floating sharded parameters gives ``first_float_numel`` (pass them in forward
        order where that matters)."""
        numel: dict[str, int] = {}
        trainable: dict[str, int] = {}
        first = 0
        replicated = replicated_float = 0
        shapes: list = []
        for m in modules:
            shapes.extend(m.sharded_param_shapes)
            for dt, nbytes in m.sharded_param_bytes_by_dtype.items():
                numel[dt] = numel.get(dt, 0) + nbytes // dtype_bytes(dt)
            own_trainable = m.trainable_sharded_param_bytes_by_dtype
            for dt, nbytes in own_trainable.items():
                trainable[dt] = trainable.get(dt, 0) + nbytes // dtype_bytes(dt)
            if not first:
                first = float_numel_of(own_trainable)
            for dt, nbytes in m.scalar_param_bytes_by_dtype.items():
                replicated += nbytes
            replicated_float += sum(nb for dt, nb in m.trainable_scalar_param_bytes_by_dtype.items() if dt in FLOAT_DTYPES)
        return UnitParams.of(numel, first, replicated, replicated_float, trainable, tuple(shapes))

    def __add__(self, other: "UnitParams") -> "UnitParams":
        """Both units' parameters as one unit's (``self``'s module first in forward order)."""
        numel, trainable = dict(self.numel_by_dtype), dict(self.trainable_numel_by_dtype)
        for dt, k in other.numel_by_dtype:
            numel[dt] = numel.get(dt, 0) + k
        for dt, k in other.trainable_numel_by_dtype:
            trainable[dt] = trainable.get(dt, 0) + k
        return UnitParams.of(numel, self.first_float_numel or other.first_float_numel,
                             self.replicated_bytes + other.replicated_bytes,
                             self.replicated_float_bytes + other.replicated_float_bytes, trainable,
                             self.sharded_shapes + other.sharded_shapes)


def _merged(shapes) -> tuple[tuple[int, int, str, bool], ...]:
    """``shapes`` with the elements of each (dim0, dtype, trainable) summed, sorted."""
    numel: dict[tuple[int, str, bool], int] = {}
    for dim0, k, dtype, trainable in shapes:
        numel[dim0, dtype, trainable] = numel.get((dim0, dtype, trainable), 0) + k
    return tuple(sorted((dim0, k, dtype, trainable) for (dim0, dtype, trainable), k in numel.items()))


def float_numel_of(param_bytes_by_dtype: dict[str, int]) -> int:
    """The floating elements of a ``param_bytes_by_dtype`` (dtype name -> bytes)."""
    return sum(nb // dtype_bytes(dt) for dt, nb in param_bytes_by_dtype.items() if dt in FLOAT_DTYPES)


def built_dtype(params: UnitParams) -> str:
    """The dtype most of ``params``' trainable sharded bytes were built in (the optimizer's states' and
    step's dtype; float32 when none train). Ties go to the dtype met first."""
    totals = {dt: k * dtype_bytes(dt) for dt, k in params.trainable_numel_by_dtype}
    return max(totals, key=totals.get) if totals else "float32"
