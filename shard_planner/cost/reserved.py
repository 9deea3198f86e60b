"""Reserved memory: the memory walk's allocations through the caching-allocator simulation, over the
first two training steps (issue 29).

:func:`simulate_reserved` runs the memory walk (cost/memory.py, or cost/accumulation.py's) twice into one
:class:`~shard_planner.cost.allocator_accountant.AllocatorAccountant` through :class:`TwoSteps`, and
reads the allocator's peaks, retries and OOM. The estimate's allocated peak is the walk's own
(cost/memory.py); this adds what the CUDA caching allocator holds to serve it.

[Note: Two steps, not one]
  ``torch.cuda.max_memory_reserved`` of a run is a maximum over all its steps, and its first two steps
  differ from the rest in the allocator's state (torch 2.13):
  - step 1 starts with an empty cache and without optimizer states: ``torch.optim.AdamW`` creates
    ``exp_avg`` / ``exp_avg_sq`` lazily inside the first ``step()`` (torch/optim/adamw.py ``_init_group``:
    ``torch.zeros_like(p, memory_format=torch.preserve_format)`` when ``len(state) == 0``), after the
    backward has freed its activations, so they are carved from the segments the activations left;
  - step 2 starts with that cache and those states, and its forward needs the activations' room again,
    now beside the states: the segments that were split for the states are not there to reuse.
  From step 2 on the allocator's state repeats (every step frees what it allocated). So the first walk
  defers the optimizer states' allocation to the optimizer step's mark, and the second walk, which emits
  the step's persistent state again (cost/memory.py ``allocate_step_state``: sharded parameters, states,
  buffers, the overhead, then the batch last), has those events dropped — they are live already — except
  the batch, which replaces what the last step left of the activations. The peaks are the larger of
  the two steps'. Step 3 and later are step 2 again and are not walked.

[Note: Activations as a stack]
  The walk emits activations as a level (cost/allocations.py [Note: Activations as a level]): one
  allocation of the whole level, freed and allocated again larger or smaller at every change. Fed to the
  allocator as such, every rise asks for a new segment of the whole level (a freed block serves only
  requests that fit in it: cost/allocator_blocks.py), which no program does. Autograd's saved tensors
  are allocated in forward order and freed in the reverse order in backward, a stack; so here a rise of
  the level is one new allocation of the rise on the compute stream, pushed on a stack, and a fall frees
  the newest ones (the last in part: it is freed and its rest allocated again). The totals are the
  walk's; the sizes are its rises, one per moment of the walk, not autograd's tensors.

[Note: What the simulated layout is]
  The walk emits memory as FSDP2 allocates its buffers (all-gather outputs, unsharded parameters,
  reduce-scatter buffers: one allocation each, on their streams, cost/allocations.py [Note: Which stream
  allocates what]) but activations as a level (a stack of its rises here: [Note: Activations as a stack]) and gradients
  per block (cost/allocator_accountant.py [Note: Frees that match no allocation]), where autograd
  allocates many tensors. The caching
  allocator's rounding, pools, segment sizes, per-stream reuse and cap are exact (cost/allocator.py);
  the layout of activations and gradients inside the segments is the walk's aggregate, not autograd's.
  benchmarks/bench_reserved.py measures what that costs against the reserved memory of real runs.

[Note: What a retry of the second step costs the allocator]
  Each retry releases the cache (cost/allocator.py [Note: Release and retry, then out of memory]): its
  driver frees (``cudaFree`` per whole free segment, or page unmaps with expandable segments) and bytes are
  :class:`StepRetry` ``free_calls`` / ``freed_bytes``; ``alloc_calls_after`` counts the driver allocations
  (``cudaMalloc`` or page maps, the retry's own included) from it to the next retry or the end of the step.
  Of those the step pays for ``forced_alloc_calls_per_step``: the second step's driver allocations less
  the unlimited run's second step's (what the step does anyway: the room its forward needs beside the
  optimizer states, [Note: Two steps, not one]). From step 2 on the unlimited allocator allocates nothing
  new, so in a run that retries every step, what it releases it allocates again: this difference is that
  re-allocation. It is the second step's, taken as every later step's as ``retries_per_step`` is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from shard_planner.cost.allocations import ACTIVATIONS, OPTIMIZER_STATES, Kind, Stream, label
from shard_planner.cost.allocator import AllocatorConfig, AllocatorStats
from shard_planner.cost.allocator_accountant import AllocatorAccountant
from shard_planner.cost.allocator_replay import AllocEvent
from shard_planner.cost.schedule import Phase

# the optimizer step's mark in the memory walk (cost/memory.py ``optimizer``)
_STEP_MARK = ("step", Phase.OPTIMIZER)


class StepRetry(NamedTuple):
    """One retry of the second step: [Note: What a retry of the second step costs the allocator]."""

    free_calls: int  # cudaFree calls, or pages unmapped
    freed_bytes: int
    alloc_calls_after: int  # cudaMalloc calls or pages mapped from it to the next retry or the step's end


@dataclass(frozen=True)
class ReservedEstimate:
    """What the caching allocator holds over the first two steps of a plan, per rank (bytes). See the
    module notes."""

    expandable_segments: bool
    device_bytes: int | None  # the memory the allocator could get in the simulation (None: unlimited)
    allocated_peak_bytes: int  # the allocator's allocated bytes at their peak (its rounding included)
    reserved_peak_bytes: int  # its segments at their peak
    outside_bytes: int  # not the allocator's: the CUDA context, NCCL's buffers, process groups (the profile)
    # the smallest allocator memory from which the two steps run without an OOM and without a retry
    # (AllocatorStats.peak_cap_demand_bytes of the unlimited run)
    no_retry_bytes: int
    num_alloc_retries: int  # under ``device_bytes``: each a release of the cache and a retry
    oom_at: str | None  # under ``device_bytes``: the moment of the first out-of-memory (None: none)
    # under ``device_bytes``: the retries of the second step, which every later step repeats ([Note: Two
    # steps, not one])
    retries_per_step: int = 0
    # under ``device_bytes``: the second step's retries, and the driver allocations they force per step
    # ([Note: What a retry of the second step costs the allocator])
    step_retries: tuple[StepRetry, ...] = ()
    forced_alloc_calls_per_step: int = 0

    @property
    def reserved_peak_total_bytes(self) -> float:
        """The device memory the process holds at its peak: the allocator's segments and the rest."""
        return self.reserved_peak_bytes + self.outside_bytes

    @property
    def no_retry_total_bytes(self) -> float:
        """The smallest device memory that runs the steps without an OOM or a retry, the rest included."""
        return self.no_retry_bytes + self.outside_bytes


class TwoSteps:
    """An accountant (cost/allocations.py) that turns two walks of one step into the first two steps of
    a run for ``inner``, an :class:`AllocatorAccountant` ([Note: Two steps, not one]), with the
    activation level as a stack of allocations ([Note: Activations as a stack]). Call :meth:`next_step`
    between the walks."""

    def __init__(self, inner: AllocatorAccountant):
        self.inner = inner
        self.step = 1
        self.in_step_state = True  # the walk's step state comes first, the batch last (allocate_step_state)
        self.deferred_states: list[tuple] = []  # step 1: the optimizer states, allocated at the step's mark
        self.level = 0.0  # the walk's activation level (its live ACTIVATIONS bytes)
        self.stack: list[int] = []  # the activation allocations made for it, bottom first (whole bytes)
        self.stack_bytes = 0

    def next_step(self) -> None:
        self.step += 1
        self.in_step_state = True

    def on_alloc(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        if kind is ACTIVATIONS:
            if self.in_step_state:  # the batch: the step state ends with it; it replaces the last step's
                self.in_step_state = False
                self.level = 0.0
            self.level += size_bytes
            self.settle()
            return
        if self.in_step_state:
            if self.step == 1 and kind is OPTIMIZER_STATES:
                self.deferred_states.append((kind, size_bytes, owner, stream))
                return
            if self.step > 1:
                return  # the step's persistent state: live since step 1
        self.inner.on_alloc(kind, size_bytes, owner, stream)

    def on_free(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        if kind is ACTIVATIONS:  # the walk allocates the new level next: settled then, or at the mark
            self.level -= size_bytes
            return
        self.inner.on_free(kind, size_bytes, owner, stream)

    def settle(self) -> None:
        """The stack of activation allocations brought to the level: one allocation of what it rose by,
        or the newest allocations freed (the last one in part) for what it fell by."""
        target = max(0, int(self.level + 0.5))
        inner = self.inner
        if target > self.stack_bytes:
            rise = target - self.stack_bytes
            inner.on_alloc(ACTIVATIONS, rise, "", Stream.DEFAULT)
            self.stack.append(rise)
        while self.stack_bytes > target and self.stack:  # (a fall leaves stack_bytes above target only here)
            excess = self.stack_bytes - target
            top = self.stack.pop()
            inner.on_free(ACTIVATIONS, top, "", Stream.DEFAULT)
            self.stack_bytes -= top
            if top > excess:  # the part that stays: allocated again
                inner.on_alloc(ACTIVATIONS, top - excess, "", Stream.DEFAULT)
                self.stack.append(top - excess)
                self.stack_bytes += top - excess
        self.stack_bytes = sum(self.stack)

    def on_mark(self, what: str, who: str, phase: Phase, temp_bytes: float, comm_bytes: float,
                stream: Stream) -> None:
        self.settle()
        if (what, phase) == _STEP_MARK and self.deferred_states:
            for state in self.deferred_states:  # created inside the first step(), before its temporaries
                self.inner.on_alloc(*state)
            self.deferred_states = []
        self.inner.on_mark(what, who, phase, temp_bytes, comm_bytes, stream)


def unlimited_run(walk, expandable_segments: bool) -> TwoStepRun:
    """The allocator without a limit over two steps of one plan (``walk`` as :func:`simulate_reserved`'s):
    what every :func:`simulate_reserved` of the plan in that mode starts from, whatever its limit."""
    return _two_steps(walk, AllocatorConfig(expandable_segments=expandable_segments))


def simulate_reserved(walk, expandable_segments: bool, device_bytes: int | None = None,
                      unlimited: TwoStepRun | None = None) -> ReservedEstimate:
    """The allocator over two steps of one plan: ``walk(accountants)`` runs the plan's memory walk with
    those extra accountants (CostModel.reserved). ``device_bytes``: the memory the allocator can get (the
    device's less what is outside it; None: unlimited). ``unlimited``: :func:`unlimited_run` of the same
    walk and mode, when the caller has it (CostModel keeps the last few: a plan is judged without a limit
    and then under its device's, cost/fits.py ``device_fit``); None: run here. Only when the unlimited
    run asks the driver for more than ``device_bytes`` is the walk run again under the limit."""
    if unlimited is None:
        unlimited = unlimited_run(walk, expandable_segments)
    stats = unlimited.accountant.stats()
    capped = unlimited
    if device_bytes is not None and stats.peak_cap_demand_bytes > device_bytes:
        capped = _two_steps(walk, AllocatorConfig(expandable_segments=expandable_segments, device_bytes=device_bytes))
    accountant = capped.accountant
    capped_stats = accountant.stats()
    step_retries = _step_retries(capped_stats, capped)
    forced = (capped_stats.device_alloc_calls - capped.first_step_alloc_calls
              - (stats.device_alloc_calls - unlimited.first_step_alloc_calls)) if step_retries else 0
    oom_at = None
    if accountant.oom is not None:
        oom_at = label(*accountant.oom_mark) if accountant.oom_mark else "the end of the step"
    return ReservedEstimate(
        expandable_segments=expandable_segments, device_bytes=device_bytes,
        allocated_peak_bytes=stats.peak_allocated_bytes, reserved_peak_bytes=stats.peak_reserved_bytes,
        outside_bytes=int(round(unlimited.accountant.outside_bytes)), no_retry_bytes=stats.peak_cap_demand_bytes,
        num_alloc_retries=capped_stats.num_alloc_retries, oom_at=oom_at,
        retries_per_step=capped_stats.num_alloc_retries - capped.first_step_retries,
        step_retries=step_retries, forced_alloc_calls_per_step=max(0, forced))


def _step_retries(stats: AllocatorStats, run: "TwoStepRun") -> tuple[StepRetry, ...]:
    """The second step's retries of a run (``stats``: its allocator's at the end): [Note: What a retry of
    the second step costs the allocator]."""
    releases = stats.retry_releases[run.first_step_retries:]
    ends = [r.alloc_calls_before for r in releases[1:]] + [stats.device_alloc_calls]
    return tuple(StepRetry(r.free_calls, r.freed_bytes, end - r.alloc_calls_before) for r, end in zip(releases, ends))


@dataclass(frozen=True)
class ReservedTimeline:
    """The allocator at every mark of the second step (the steady state: [Note: Two steps, not one]), for
    the report's timeline: ``marks`` of (what, who, phase, allocated bytes, reserved bytes), the allocator's
    own bytes (scratch included, ``outside_bytes`` not), one per mark of the memory walk, in its order; fewer
    when the step ran out of memory under ``device_bytes``."""

    expandable_segments: bool
    device_bytes: int | None
    outside_bytes: int
    marks: tuple[tuple, ...]


def simulate_reserved_timeline(walk, expandable_segments: bool, device_bytes: int | None = None) -> ReservedTimeline:
    """:func:`simulate_reserved`'s allocator, keeping its state at every mark of the second step."""
    run = _two_steps(walk, AllocatorConfig(expandable_segments=expandable_segments, device_bytes=device_bytes),
                     timeline=True)
    return ReservedTimeline(expandable_segments, device_bytes, int(round(run.accountant.outside_bytes)),
                            tuple(run.accountant.marks[run.first_step_marks:]))


def simulated_events(walk, expandable_segments: bool) -> list[AllocEvent]:
    """Every call the simulated allocator gets over the two steps, without a limit, as cost/allocator_replay.py
    events: replayed under a ``set_per_process_memory_fraction`` cap, or compared with a recorded trace."""
    return _two_steps(walk, AllocatorConfig(expandable_segments=expandable_segments), record=True).accountant.events


class TwoStepRun(NamedTuple):
    """One run of the allocator over two steps (read only once it has run)."""


    accountant: AllocatorAccountant
    first_step_retries: int  # the allocator's retries when the first step ended
    first_step_marks: int  # how many of ``accountant.marks`` are the first step's (0 without a timeline)
    first_step_alloc_calls: int = 0  # the allocator's driver allocations when the first step ended


def _two_steps(walk, config: AllocatorConfig, timeline: bool = False, record: bool = False) -> TwoStepRun:
    accountant = AllocatorAccountant(config, timeline=timeline, record=record)
    steps = TwoSteps(accountant)
    walk((steps,))
    first = TwoStepRun(accountant, accountant.allocator.num_alloc_retries, len(accountant.marks) if timeline else 0,
                        accountant.allocator.device_alloc_calls)
    steps.next_step()
    walk((steps,))
    return first
