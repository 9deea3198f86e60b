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
