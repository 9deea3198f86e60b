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
class ExposedParts:
    """What exposed communication is made of, seconds: [Note: The parts of exposed communication]."""

    wait_s: float  # the compute stream waiting for FSDP's collectives (all the collectives on a CPU profile)
    copies_s: float  # FSDP2's copies on the compute stream (all-gather copy-out, reduce-scatter copy-in)
    slowdown_s: float  # compute slowed while the communication stream runs (the profile's overlap slowdown)
    tp_s: float  # tensor-parallel collectives, on the compute stream's critical path

    # the parts' names for people, in order: estimate's line, the units table's columns, the units figure's legend
    NAMES = (("wait_s", "waiting for FSDP collectives"), ("copies_s", "FSDP2's copies"),
             ("slowdown_s", "compute slowed by overlapped collectives"), ("tp_s", "tensor-parallel collectives"))
    SHORT_NAMES = {"wait_s": "waited", "copies_s": "copies", "slowdown_s": "slowdown", "tp_s": "TP"}  # table columns

    @property
    def total_s(self) -> float:
        return self.wait_s + self.copies_s + self.slowdown_s + self.tp_s


@dataclass(frozen=True)
class UnitTime:
    """Per FSDP unit, for one training step (seconds).

    [Note: The parts of exposed communication]
      A unit's exposed communication is the time its collectives add to the compute stream's step (cost/time.py):
      the stream's wait for the unit's all-gathers (and, at the root, the optimizer's wait for the last
      reduce-scatter), FSDP2's copies for the unit on the compute stream, the unit's compute slowed while
      collectives overlap it, and the unit's tensor-parallel collectives. ``exposed_comm_s`` is their sum; the
      simulator counts the last three apart (defaults 0: a UnitTime without them counts all as waiting), so
      the wait is the rest (:attr:`parts`). For the step, :meth:`TimeEstimate.exposed_parts`: the units' parts
      and the loss's tensor-parallel collectives, which add up to ``step - compute - optimizer``.
    """

    name: str  # Unit.name
    fwd_compute_s: float
    bwd_compute_s: float  # recomputation of a checkpointed unit included
    all_gather_s: float  # all forward and backward all-gathers of this unit together
    reduce_scatter_s: float
    exposed_comm_s: float  # communication time the compute stream waited for because of this unit, all parts
    copies_s: float = 0.0  # of it: FSDP2's copies (see the note)
    slowdown_s: float = 0.0  # of it: compute slowed by overlapped collectives
    tp_s: float = 0.0  # of it: tensor-parallel collectives

    @property
    def parts(self) -> ExposedParts:
        """``exposed_comm_s`` in its parts ([Note: The parts of exposed communication])."""
        wait_s = max(0.0, self.exposed_comm_s - self.copies_s - self.slowdown_s - self.tp_s)
        return ExposedParts(wait_s, self.copies_s, self.slowdown_s, self.tp_s)


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

    def exposed_parts(self) -> ExposedParts:
        """``exposed_comm_s`` in its parts, the units' summed with the loss's tensor-parallel collectives (UnitTime
        [Note: The parts of exposed communication]); the wait is the rest, so the parts add up to it."""
        copies_s = sum(u.copies_s for u in self.units)
        slowdown_s = sum(u.slowdown_s for u in self.units)
        tp_s = self.tp_comm_s
        return ExposedParts(max(0.0, self.exposed_comm_s - copies_s - slowdown_s - tp_s), copies_s, slowdown_s, tp_s)

    @property
    def fsdp_comm_s(self) -> float:
        """FSDP's collectives on their stream (all-gathers, reduce-scatters; ``comm_s`` less the TP ones)."""
        return self.comm_s - self.tp_comm_s


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
