"""What one FSDP unit's own parameters are, as every per-unit rule reads them.

A unit (``fully_shard`` of one or more modules) owns the parameters of its modules' subtrees that no
unit nested below it owns. The per-unit rules (cost/unit_cost.py: bytes by kind, collectives, FSDP2's
copies) need of them: the sharded parameters' elements by built dtype — floating ones are cast to the
param dtype, all-gathered and get gradients; others (integer, bool) are all-gathered as built and get
none —, the floating elements of its first module in forward order that holds parameters (their
gradient is the last autograd produces for the unit: cost/memory.py [Note: Reduce-scatter buffers]),
and its 0-d parameters, which FSDP2 cannot shard and the plan replicates (execute/apply.py [Note: 0-d
parameters]).

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
    """One unit's own parameters (bytes and elements on one rank before sharding, as built)."""

    numel_by_dtype: tuple[tuple[str, int], ...]  # sharded (not 0-d) parameters: (built dtype, elements)
    first_float_numel: int  # floating elements of its first module in forward order holding parameters
    replicated_bytes: int = 0  # 0-d parameters, whole on every rank
    replicated_float_bytes: int = 0  # of those, the floating ones (they get a whole gradient)
    # derived from numel_by_dtype by ``of`` (the simulators' inner loops read them)
    float_numel: int = 0  # floating elements: cast to the param dtype, gathered, given gradients
    float_built_bytes: int = 0  # their bytes as built
    other_bytes: int = 0  # non-floating parameters: gathered as built, no gradient, never cast
    float_dtypes: frozenset = frozenset()

    @staticmethod
    def of(numel_by_dtype: dict[str, int], first_float_numel: int = 0, replicated_bytes: int = 0,
           replicated_float_bytes: int = 0) -> "UnitParams":
        floats = [(dt, k) for dt, k in numel_by_dtype.items() if dt in FLOAT_DTYPES]
        return UnitParams(
            numel_by_dtype=tuple(numel_by_dtype.items()), first_float_numel=first_float_numel,
            replicated_bytes=replicated_bytes, replicated_float_bytes=replicated_float_bytes,
            float_numel=sum(k for _, k in floats), float_built_bytes=sum(k * dtype_bytes(dt) for dt, k in floats),
            other_bytes=sum(k * dtype_bytes(dt) for dt, k in numel_by_dtype.items() if dt not in FLOAT_DTYPES),
            float_dtypes=frozenset(dt for dt, _ in floats))

    @staticmethod
    def of_modules(modules: Iterable) -> "UnitParams":
        """The parameters registered on ``modules`` (trace ModuleTraces), in the order given: the first
        that holds sharded parameters gives ``first_float_numel`` (pass them in forward order where
        that matters)."""
        numel: dict[str, int] = {}
        first = None
        replicated = replicated_float = 0
        for m in modules:
            own = m.sharded_param_bytes_by_dtype
            for dt, nbytes in own.items():
                numel[dt] = numel.get(dt, 0) + nbytes // dtype_bytes(dt)
            if first is None and own:
                first = first_float_numel_of(own)
            for dt, nbytes in m.scalar_param_bytes_by_dtype.items():
                replicated += nbytes
                replicated_float += nbytes if dt in FLOAT_DTYPES else 0
        return UnitParams.of(numel, first or 0, replicated, replicated_float)

    def __add__(self, other: "UnitParams") -> "UnitParams":
        """Both units' parameters as one unit's (``self``'s module first in forward order)."""
        numel = dict(self.numel_by_dtype)
        for dt, k in other.numel_by_dtype:
            numel[dt] = numel.get(dt, 0) + k
        return UnitParams.of(numel, self.first_float_numel or other.first_float_numel,
                             self.replicated_bytes + other.replicated_bytes,
                             self.replicated_float_bytes + other.replicated_float_bytes)

    @property
    def numel(self) -> int:
        """Every sharded parameter element."""
        return sum(k for _, k in self.numel_by_dtype)


NO_PARAMS = UnitParams.of({})


def first_float_numel_of(param_bytes_by_dtype: dict[str, int]) -> int:
    """The floating elements of one module's ``param_bytes_by_dtype``."""
    return sum(nb // dtype_bytes(dt) for dt, nb in param_bytes_by_dtype.items() if dt in FLOAT_DTYPES)


def built_dtype(params: UnitParams) -> str:
    """The dtype most of ``params``' sharded bytes were built in (FSDP2's sharded dtype for the
    optimizer step; float32 when there are none). Ties go to the dtype met first."""
    totals = {dt: k * dtype_bytes(dt) for dt, k in params.numel_by_dtype}
    return max(totals, key=totals.get) if totals else "float32"
