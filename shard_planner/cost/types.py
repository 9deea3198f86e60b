"""What the cost model returns: the memory timeline with its peak, and the step time.

Produced by ``shard_planner.cost.simulate_memory`` / ``simulate_time`` / ``estimate``
(all ``(trace, plan, profile) -> ...``, pure functions); consumed by the solver (re-check), the CLI
(``estimate``, ``plan``) and the report (plots).
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.cost.schedule import Phase
from shard_planner.plan import MEMORY_CATEGORIES, Prediction


@dataclass(frozen=True)
class MemoryEvent:
    """Live bytes on one rank right after one event of the training step."""

    label: str  # e.g. "forward: all-gather layers.3", "backward: reduce-scatter layers.3", "optimizer step"
    phase: Phase
    bytes_by_category: dict[str, int]  # MEMORY_CATEGORIES -> bytes

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_category.values())


@dataclass(frozen=True)
class MemoryEstimate:
    peak_bytes: int  # max over the timeline, overhead included
    memory_at_peak: dict[str, int]  # MEMORY_CATEGORIES -> bytes at the peak event
    peak_event: str  # label of the event where the peak occurs
    timeline: tuple[MemoryEvent, ...]

    def __post_init__(self):
        assert set(self.memory_at_peak) <= set(MEMORY_CATEGORIES)


@dataclass(frozen=True)
class UnitTime:
    """Per FSDP unit, for one training step (seconds)."""

    name: str  # Unit.name
    fwd_compute_s: float
    bwd_compute_s: float  # recomputation of a checkpointed unit included
    all_gather_s: float  # all forward and backward all-gathers of this unit together
    reduce_scatter_s: float
    exposed_comm_s: float  # communication time the compute stream waited for because of this unit


@dataclass(frozen=True)
class TimeEstimate:
    step_time_s: float
    compute_s: float  # compute stream busy time (forward, backward, recomputation)
    comm_s: float  # communication stream busy time
    exposed_comm_s: float  # step_time_s minus what the compute stream and optimizer account for
    optimizer_s: float
    samples_per_s: float  # over the whole cluster (all data-parallel ranks)
    tokens_per_s: float | None  # over the whole cluster; None for models without tokens
    mfu: float  # model FLOPs (no recomputation) / (step time x peak FLOP/s), per GPU
    units: tuple[UnitTime, ...]
    tp_comm_s: float = 0.0  # tensor-parallel collectives, on the compute stream's critical path (in comm_s too)


@dataclass(frozen=True)
class Estimate:
    memory: MemoryEstimate
    time: TimeEstimate

    def prediction(self) -> Prediction:
        """The plan file's ``predicted`` section."""
        return Prediction(
            peak_bytes=self.memory.peak_bytes,
            step_time_s=self.time.step_time_s,
            memory_at_peak=dict(self.memory.memory_at_peak),
            samples_per_s=self.time.samples_per_s,
            tokens_per_s=self.time.tokens_per_s,
            exposed_comm_s=self.time.exposed_comm_s,
            mfu=self.time.mfu,
        )
