"""One FSDP unit's state inside one memory walk (cost/memory.py): where its parameters are, what it
has pending or holds. Never shared between walks."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Sharding(enum.Enum):
    """Where a unit's parameters are, on one rank, during the simulated step."""

    SHARDED = "sharded"  # only the 1/N shard
    GATHERING = "gathering"  # an all-gather is issued, its output pending (``pending_bytes``)
    UNSHARDED = "unsharded"  # copied out: the full parameters in the param dtype
    RESHARDED_TO_GROUP = "resharded to a smaller group"  # keeps the 1/r clone ([Note: Reshard to a smaller group])


@dataclass(slots=True)
class UnitState:
    """One unit's state inside one memory simulation (never shared between simulations)."""

    sharding: Sharding = Sharding.SHARDED
    pending_bytes: float = 0.0  # all-gather output issued and not yet copied out
    group_clone_bytes: float = 0.0  # the post-forward 1/r clone held (RESHARDED_TO_GROUP, or gathering from it)
    grad_bytes: float = 0.0  # unsharded gradients produced in backward, not yet reduce-scattered
