"""The hand-written policies people use today, as plans on the same model, judged by the same
simulators, so the chosen plan can be placed beside them.

- torchtitan default (torchtitan/distributed/fsdp.py, models/llama3/parallelize.py): one unit per
  transformer block with ``reshard_after_forward=True``; the root (embeddings, final norm, head) is
  wrapped last and not resharded.
- Accelerate ``TRANSFORMER_BASED_WRAP``: every module of the transformer-layer class is a unit, the
  root too, all ``FULL_SHARD`` (reshard True, the root included).
- Accelerate ``SIZE_BASED_WRAP`` (``min_num_params`` 1e8, Accelerate's default): units of at least
  that many parameters, grouped greedily along the sequence of sibling modules; what is left stays in
  the root.
- ZeRO-2-like: the torchtitan units with ``reshard_after_forward=False`` everywhere (parameters stay
  gathered from forward to backward).
- full activation checkpointing: the torchtitan units, every block checkpointed.

"Blocks" are the repeated items of the search space (modules with a structurally identical sibling);
a model without repeated blocks uses every item. Every policy wraps only the search space's items, so
like the solver's plans it never wraps a module whose forward never runs (a ``ModuleList``) nor one
that holds only part of a group of tied weights: those stay in the root unit (see
:mod:`shard_planner.solve.space`).
"""

from __future__ import annotations

from collections import Counter

from shard_planner.plan import ROOT, Unit
from shard_planner.solve.space import SearchSpace, checkpointing_allowed
from shard_planner.trace.types import ModelTrace

SIZE_BASED_MIN_NUM_PARAMS = 100_000_000  # accelerate FullyShardedDataParallelPlugin default (min_num_params=1e8)


def _blocks(space: SearchSpace) -> list[str]:
    parents = Counter(it.parent for it in space.items if not it.may_join_root)
    blocks = [it.fqn for it in space.items if not it.may_join_root and parents[it.parent] >= 2]
    return blocks or [it.fqn for it in space.items]


def torchtitan_default(space: SearchSpace) -> tuple[Unit, ...]:
    return (Unit((ROOT,), False), *(Unit((b,), True) for b in _blocks(space)))


def accelerate_transformer_wrap(space: SearchSpace) -> tuple[Unit, ...]:
    return (Unit((ROOT,), True), *(Unit((b,), True) for b in _blocks(space)))


def accelerate_size_wrap(space: SearchSpace, min_num_params: int = SIZE_BASED_MIN_NUM_PARAMS) -> tuple[Unit, ...]:
    units = [Unit((ROOT,), True)]
    group: list = []
    for it in space.items:
        if group and group[-1].parent != it.parent:
            group = []  # only siblings share a unit; a short run stays in the root
        group.append(it)
        if sum(g.param_count for g in group) >= min_num_params:
            units.append(Unit(tuple(g.fqn for g in group), True))
            group = []
    return tuple(units)


def zero2_like(space: SearchSpace) -> tuple[Unit, ...]:
    return (Unit((ROOT,), False), *(Unit((b,), False) for b in _blocks(space)))


def full_checkpointing(space: SearchSpace) -> tuple[Unit, ...]:
    return (Unit((ROOT,), False), *(Unit((b,), True, activation_checkpoint=True) for b in _blocks(space)))


POLICIES = (
    ("torchtitan default (per block, reshard)", torchtitan_default),
    ("Accelerate TRANSFORMER_BASED_WRAP", accelerate_transformer_wrap),
    ("Accelerate SIZE_BASED_WRAP (1e8)", accelerate_size_wrap),
    ("ZeRO-2-like (no reshard)", zero2_like),
    ("full activation checkpointing", full_checkpointing),
)


def hand_written_units(space: SearchSpace, trace: ModelTrace) -> list[tuple[str, tuple[Unit, ...]]]:
    """(name, units) of each policy in :data:`POLICIES` for ``space``, without those that checkpoint a
    model that may not be checkpointed (:func:`~shard_planner.solve.space.checkpointing_allowed`)."""
    allowed = checkpointing_allowed(trace)
    made = [(name, make(space)) for name, make in POLICIES]
    return [(name, units) for name, units in made if allowed or not any(u.activation_checkpoint for u in units)]
