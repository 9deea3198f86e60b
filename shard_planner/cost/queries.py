"""The questions a CostModel answers, as frozen objects: every memo of cost/model.py is keyed by one.

[Note: A memo is keyed by its function's query]
Each function CostModel memoises takes one query object — a frozen dataclass below holding exactly what
the function reads — and reads nothing else: not the plan, not a field picked out of the plan beside the
query. The memo is keyed by that object (``_LRU.get_or(query, fn)`` calls ``fn(query)``), so whatever a
function reads is in its key by construction: a new dimension added to a query is in the key the moment
a function can read it, and a field left out of a query cannot be read (AttributeError), where a key
picked by hand went stale without an error. Each query is built from the plan in one place, its ``of``;
a query that needs a narrower one derives it with the narrower one's ``of`` (a :class:`PlanQuery` has
the plan's ``units``, ``prefetch``, ``mesh`` and ``training``, so every ``of`` takes it as it takes a plan).

The fields are frozen values whose equality is their meaning: tuples, ints, strings and the plan's own
frozen dataclasses (``Unit``, ``Mesh``, ``Prefetch``, ``Training``, ``Numerics``), so that a field added to one of those
is in every key that holds it. ``Unit.reshard_after_forward`` cannot be 1, so True == 1 cannot make two
decisions one key. A query's hash is computed once (``_query``): a plan's 80 Units take longer to hash
than a step of the simulation.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.plan import Mesh, Prefetch, Training, Unit
from shard_planner.plan.numerics import Numerics


def _query(cls):
    """``dataclass(frozen=True)`` whose hash (of every field, the dataclass's own) is computed once."""
    cls = dataclass(frozen=True)(cls)
    fields_hash = cls.__hash__

    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = self.__dict__["_hash"] = fields_hash(self)
            return h
    cls.__hash__ = __hash__
    return cls


class _Units(tuple):
    """A plan's units, hashed once: every query built from one :class:`PlanQuery` holds the same one,
    so the estimate's memos hash its Units once and compare them by identity."""

    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
            return h


def units_of(plan) -> _Units:
    """``plan.units`` as a query holds them."""
    return plan.units if type(plan.units) is _Units else _Units(plan.units)


def segmentation_of(units: tuple[Unit, ...]) -> tuple[tuple[str, ...], ...]:
    """The units' modules: what the cost tables (cost/tables.py ``segment_tables``) are of."""
    return tuple(u.modules for u in units)


@_query
class BatchQuery:
    """The forward price of a module (CostModel.forward_price) and its kernel seconds: one micro-batch under
    one numerics policy (plan/numerics.py: the activations' dtype, each module's GEMM dtype)."""

    micro_batch: int
    numerics: Numerics

    @staticmethod
    def of(training: Training) -> "BatchQuery":
        return BatchQuery(training.micro_batch, training.numerics)


@_query
class SubtreeQuery:
    """What selective checkpointing of one subtree keeps and skips recomputing (``save_ops``), or (None)
    the share of its forward a full checkpoint's early stop skips, at one micro-batch and numerics."""

    fqn: str
    save_ops: tuple[str, ...] | None
    batch: BatchQuery


@_query
class BlockQuery:
    """Per block of one segmentation, at one micro-batch and numerics: activations and compute seconds."""

    segmentation: tuple[tuple[str, ...], ...]
    batch: BatchQuery

    @staticmethod
    def of(plan) -> "BlockQuery":
        return BlockQuery(segmentation_of(plan.units), BatchQuery.of(plan.training))


@_query
class ScheduleQuery:
    """The step's event sequence (the engine's: FSDP2's is cost/schedule.py): the units' decisions and the
    prefetch depths."""

    units: tuple[Unit, ...]
    prefetch: Prefetch
    engine: str

    @staticmethod
    def of(plan) -> "ScheduleQuery":
        return ScheduleQuery(units_of(plan), plan.prefetch, plan.engine)


@_query
class SelectiveQuery:
    """Per block, what selective checkpointing keeps (cost/selective.py): the units' checkpoint decisions
    at one micro-batch and numerics."""

    units: tuple[Unit, ...]
    batch: BatchQuery

    @staticmethod
    def of(plan) -> "SelectiveQuery":
        return SelectiveQuery(units_of(plan), BatchQuery.of(plan.training))


@_query
class UnitBytesQuery:
    """Every unit's byte sizes (cost/unit_bytes.py): the units, the shard group and the numerics."""

    units: tuple[Unit, ...]
    shard_group_size: int  # the layout's (parallel/mesh.py), read here as a key: the one size unit bytes depend on
    numerics: Numerics
    engine: str

    @staticmethod
    def of(plan) -> "UnitBytesQuery":
        return UnitBytesQuery(units_of(plan), plan.mesh.shard_group_size, plan.training.numerics, plan.engine)


@_query
class UnitSetting:
    """What one plan decides for all its units alike, as the per-unit cost (the engine's: FSDP2's is
    cost/unit_cost.py) reads it: the mesh, the numerics, the optimizer, CPU offload and the engine."""

    mesh: Mesh
    numerics: Numerics
    optimizer: str
    cpu_offload: bool
    engine: str

    @staticmethod
    def of(plan) -> "UnitSetting":
        tr = plan.training
        return UnitSetting(plan.mesh, tr.numerics, tr.optimizer, tr.cpu_offload, plan.engine)


@_query
class UnitCostsQuery:
    """Every unit's cost (cost/unit_cost.py): the units (their modules and ``reshard_after_forward``) and
    the plan's setting."""

    units: tuple[Unit, ...]
    setting: UnitSetting

    @staticmethod
    def of(plan) -> "UnitCostsQuery":
        return UnitCostsQuery(units_of(plan), UnitSetting.of(plan))


@_query
class PlanQuery:
    """A plan's decisions — what the memory and time simulators read — without its prediction, solver,
    frontier or cluster: the key of the estimate memos, and the ``plan`` the walks are given. ``engine``:
    whose rules price them (cost/engines/)."""

    units: tuple[Unit, ...]
    prefetch: Prefetch
    mesh: Mesh
    training: Training
    engine: str

    @staticmethod
    def of(plan) -> "PlanQuery":
        return PlanQuery(units_of(plan), plan.prefetch, plan.mesh, plan.training, plan.engine)


@_query
class ReservedQuery:
    """A plan's reserved memory through the caching-allocator simulation (cost/reserved.py): the plan, the
    allocator's mode and the memory it can get (None: unlimited)."""

    plan: PlanQuery
    expandable_segments: bool
    device_bytes: int | None
