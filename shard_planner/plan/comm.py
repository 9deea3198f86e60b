"""Collective-communication counts per step: the data type the cost model's prediction
(cost/comm_bytes.py), the run's counter (execute/comm_count.py) and the measurement share. No torch."""

from __future__ import annotations

from dataclasses import dataclass

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)


@dataclass(frozen=True)
class CollectiveBytes:
    """``calls`` collectives of one kind over groups of ``group_size`` ranks in one step, ``bytes`` in all:
    message sizes as nccl-tests report them (the full output of an all-gather, the full input of a
    reduce-scatter, the buffer of an all-reduce)."""

    collective: str  # one of COLLECTIVES
    group_size: int
    calls: int
    bytes: int

    def __post_init__(self):
        if self.collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {self.collective!r}")


# Who issued a collective: FSDP2 (through torch.distributed's functions) or DTensor (its functional
# collectives: tensor parallelism's redistributions and loss parallelism's reductions).
FSDP, TP = "fsdp", "tp"
SOURCES = (FSDP, TP)
ALL_TO_ALL, BROADCAST = "all_to_all", "broadcast"  # DTensor may also issue these (a Shard(i) -> Shard(j) move)


@dataclass(frozen=True)
class GroupCollectiveBytes:
    """``calls`` collectives of one kind that ``source`` issued over one process group in one step, ``bytes``
    in all (message sizes as in :class:`CollectiveBytes`). ``group`` names the group by its device-mesh
    dimensions ("shard", "replicate", "tp", "replicate+shard"), or "world", or "N ranks" for a group that is
    no mesh dimension (FSDP2's group of an int ``reshard_after_forward``)."""

    source: str  # one of SOURCES
    group: str
    collective: str  # one of COLLECTIVES, or ALL_TO_ALL / BROADCAST
    group_size: int
    calls: int
    bytes: int

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.collective not in (*COLLECTIVES, ALL_TO_ALL, BROADCAST):
            raise ValueError(f"unknown collective {self.collective!r}")
