"""What a unit's ``reshard_after_forward`` means to FSDP2: written once, read by every stage that prices it.

[Note: Reshard after forward]
torch 2.13's ``fully_shard(reshard_after_forward=...)`` (torch/distributed/fsdp/_fully_shard/_fully_shard.py,
``_get_post_forward_mesh_info``) takes:

- ``True``: after forward the unit frees its unsharded parameters; backward all-gathers them again over
  the shard group (ALWAYS);
- ``False`` (the root's ``None`` too): they stay unsharded until after backward; no all-gather in
  backward (NEVER);
- an int ``r``: after forward the unit keeps a 1/r clone of the unsharded parameters
  (``FSDPParam.to_sharded_post_forward``) and backward all-gathers over a group of ``r`` ranks
  (TO_GROUP). ``r`` must divide the shard group size; equal to it, FSDP2 builds the same mesh as for
  True and it silently behaves as True (DESIGN.md "FSDP2 facts"), so ``of`` reads it as ALWAYS.
  (Plan validation refuses ``r`` equal to the group; the count of bytes that ``run`` compares with
  reads whatever plan it is given.)

Every reader — the step's events (cost/schedule.py), the unit bytes (cost/unit_bytes.py), the
collectives' seconds (cost/time.py) and bytes (cost/comm_bytes.py), the memory walk's process groups
(cost/memory.py) and the solver's linear model (solve/linear.py) — asks :meth:`ReshardAfterForward.of`.
Which collectives each meaning issues per step is cost/fsdp2_rules.py's ``unit_collectives_of`` ([Note: The
collectives of each reshard policy]).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import lru_cache


class Reshard(enum.Enum):
    ALWAYS = "always"  # True: free after forward, all-gather again over the shard group in backward
    NEVER = "never"  # False: keep the unsharded parameters until after backward
    TO_GROUP = "to group"  # an int r smaller than the shard group: keep a 1/r clone, re-gather over r ranks


def reshards_after_forward(value: bool | int) -> bool:
    """Whether a unit with this ``reshard_after_forward`` frees its unsharded parameters after forward
    (True or any int: ALWAYS or TO_GROUP), whatever the shard group's size. See [Note: Reshard after
    forward]."""
    return value is not False and value is not None  # None: False (FSDP2's default for the root)


@dataclass(frozen=True, slots=True)
class ReshardAfterForward:
    """One unit's ``reshard_after_forward`` on a shard group: see [Note: Reshard after forward]."""

    kind: Reshard
    group_size: int  # ranks of the backward all-gather: the shard group (ALWAYS), r (TO_GROUP), 0 (NEVER)

    @staticmethod
    def of(value: bool | int, shard_group_size: int) -> "ReshardAfterForward":
        return _of(value, shard_group_size)

    @property
    def reshards(self) -> bool:
        """Frees the unsharded parameters after forward, and so all-gathers again in backward."""
        return self.kind is not Reshard.NEVER

    @property
    def to_group(self) -> bool:
        """Reshards to a smaller group (an int): a 1/r clone and a process group of its own."""
        return self.kind is Reshard.TO_GROUP

    def clone_bytes(self, unsharded_bytes: float) -> float:
        """The 1/r clone of ``unsharded_bytes`` kept after forward (TO_GROUP), else 0
        (``FSDPParam.to_sharded_post_forward``: ``.clone()`` of this rank's 1/r)."""
        return unsharded_bytes / self.group_size if self.kind is Reshard.TO_GROUP else 0.0

    def kept_after_forward_bytes(self, unsharded_bytes: float) -> float:
        """Of ``unsharded_bytes`` of gathered parameters, what stays live from forward to backward:
        all of them (NEVER), the 1/r clone (TO_GROUP) or nothing (ALWAYS)."""
        return unsharded_bytes if self.kind is Reshard.NEVER else self.clone_bytes(unsharded_bytes)


def reshard_group_sizes(units, shard_group_size: int) -> set[int]:
    """The distinct smaller groups ``units`` reshard to: FSDP2 creates a process group for each (about
    1 GB of NCCL memory per group on GPU, pytorch#153302; DESIGN.md "FSDP2 facts")."""
    return {r.group_size for r in (ReshardAfterForward.of(u.reshard_after_forward, shard_group_size) for u in units)
            if r.to_group}


@lru_cache(maxsize=None, typed=True)  # typed: True and the int 1 are different decisions
def _of(value: bool | int, shard_group_size: int) -> ReshardAfterForward:
    if not reshards_after_forward(value):
        return ReshardAfterForward(Reshard.NEVER, 0)
    if value is True or value == shard_group_size:  # an int equal to the group acts as True
        return ReshardAfterForward(Reshard.ALWAYS, shard_group_size)
    return ReshardAfterForward(Reshard.TO_GROUP, int(value))
