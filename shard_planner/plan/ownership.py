"""Which unit owns a module, and which tied modules a set of units would split. No torch.

FSDP2 shards a module's own parameters in the innermost unit wrapping it: the nearest module at or
above it (by fully qualified name; ``""`` is the root) that is one of a unit's modules. Modules that
register the same Parameter object (tied weights, e.g. GPT-2's ``wte``/``lm_head``) form a tie group,
and FSDP2 shards a Parameter in one unit only, so a group must not have two owners.

Used by the executor's plan check (execute/apply.py), the report's per-unit rows (report/rows.py) and
the planner's candidate modules (solve/space.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TypeVar

T = TypeVar("T")


def innermost_unit(fqn: str, unit_of: Mapping[str, T]) -> T | None:
    """``unit_of`` of the nearest module at or above ``fqn`` that it maps; None if none does (the
    module stays unwrapped)."""
    while fqn not in unit_of:
        if fqn == "":
            return None
        fqn = fqn.rpartition(".")[0]
    return unit_of[fqn]


def owners(unit_of: Mapping[str, T], fqns: Iterable[str]) -> dict[str, T | None]:
    """fqn -> its owner unit (:func:`innermost_unit`), for every module in ``fqns``."""
    return {fqn: innermost_unit(fqn, unit_of) for fqn in fqns}


def tie_groups(tied_with: Iterable[tuple[str, Iterable[str]]]) -> tuple[frozenset[str], ...]:
    """The tie groups, from (fqn, modules sharing a parameter with it) pairs (connected components)."""
    group_of: dict[str, set[str]] = {}
    for fqn, others in tied_with:
        merged = {fqn, *others}
        for member in list(merged):
            merged |= group_of.get(member, set())
        for member in merged:
            group_of[member] = merged
    unique = {id(g): g for g in group_of.values() if len(g) > 1}
    return tuple(frozenset(g) for g in unique.values())


def split_groups(groups: Iterable[frozenset[str]], owner: Callable[[str], Hashable]) -> tuple[frozenset[str], ...]:
    """The tie groups whose modules do not all have the same ``owner``."""
    return tuple(g for g in groups if len({owner(fqn) for fqn in g}) > 1)


def contiguous_among(siblings: Iterable[str], group: Iterable[str]) -> bool:
    """Whether the names in ``group`` are one unbroken run of ``siblings`` (a parent's children that
    hold parameters, in registration order), in any listed order. The executor's check of a grouped
    unit and the planner's candidate groups use this one rule: parameter-less siblings (dropout,
    activations) between them do not break a group, a sibling with parameters does (its forward
    would run inside the group's all-gather window while its parameters live in another unit)."""
    order = list(siblings)
    members = set(group)
    if not members <= set(order):
        return False
    positions = sorted(order.index(name) for name in members)
    return positions == list(range(positions[0], positions[0] + len(positions)))
