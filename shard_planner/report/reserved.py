"""The CUDA caching allocator in the report: the memory it holds (reserved) beside the memory it hands out.

On a GPU profile the memory timeline draws, over the stack of allocated bytes by category, the reserved
bytes the caching-allocator simulation holds at every event of the step (cost/reserved.py
``simulate_reserved_timeline``: the second step, the steady state), in the plan's allocator mode, with no
memory limit, with the profile's outside bytes (CUDA context, NCCL) added so that it compares with the
stack, which counts them as "overhead". Its peak is the plan file's ``predicted.reserved_peak_bytes``, the
one reserved figure the summary, ``plan`` and ``estimate`` give (cost/fits.py ``allocator_figures_text``):
the legend says it and nothing else. On a GPU of --mem the allocator gets less (cost/fits.py
``allocator_bytes``); where the line passes that plus the outside bytes, it releases its cache and retries,
and the caption says so with the plan's retries per step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from shard_planner.hardware.allocator_conf import mode_name
from shard_planner.cost.reserved import ReservedTimeline
from shard_planner.cost.types import MemoryEvent
from shard_planner.plan import Plan
from shard_planner.units import format_bytes

logger = logging.getLogger(__name__)

RESERVED_COLOR = "#111111"


@dataclass(frozen=True)
class ReservedLine:
    """The allocator over the plan's second step with no memory limit, and what it gets on a GPU of --mem."""

    timeline: ReservedTimeline
    allocator_bytes: int  # cost/fits.py allocator_bytes: (--mem - outside) x usable_fraction
    mem_bytes: int  # --mem, at most the device's memory
    retries_per_step: int  # on --mem (cost/fits.py FitVerdict)

    @property
    def peak_total_bytes(self) -> int:
        """The most it holds, outside bytes included: the plan's ``reserved_peak_bytes`` (without a limit the
        reserved bytes never fall, so the second step's last marks hold the two steps' peak)."""
        return max((m[4] for m in self.timeline.marks), default=0) + self.timeline.outside_bytes


def reserved_timeline(plan: Plan, trace, profile) -> ReservedLine | None:
    """The simulated allocator over ``plan``'s step with no memory limit, and the memory it would get on --mem
    (None without a trace, or on a CPU profile)."""
    if trace is None or profile is None or profile.device != "cuda":
        return None
    from shard_planner.cost import CostModel  # imported late, as the report's estimate is
    from shard_planner.cost.fits import device_fit

    cm = CostModel(trace, profile)
    fit = device_fit(cm, plan)
    return ReservedLine(cm.reserved_timeline(plan, plan.cluster.expandable_segments, device_bytes=None),
                        fit.allocator_bytes, fit.mem_bytes, fit.retries_per_step)


def draw_reserved(ax, events: Sequence[MemoryEvent], reserved: ReservedLine | None, scale: float) -> None:
    """The reserved bytes (outside bytes added) as a line over the timeline's stack, one step per event
    (gid "reserved"), its peak in the legend; nothing when the simulation's marks do not match the timeline's
    events."""
    if reserved is None or not reserved.timeline.marks:
        return
    marks, outside = reserved.timeline.marks, reserved.timeline.outside_bytes
    if len(marks) != len(events):
        logger.warning("the allocator simulation has %d marks for %d timeline events: no reserved line",
                       len(marks), len(events))
        return
    ys = [(m[4] + outside) / scale for m in marks for _ in (0, 1)]
    xs = [x for i in range(len(marks)) for x in (i - 0.5, i + 0.5)]
    ax.plot(xs, ys, color=RESERVED_COLOR, lw=1.3, zorder=4, gid="reserved",
            label=f"reserved (CUDA caching allocator, simulated,\nno memory limit), peak "
                  f"{format_bytes(reserved.peak_total_bytes)}")


def reserved_caption(reserved: ReservedLine | None) -> str:
    """What the reserved line is, for the memory section's caption ("" without one)."""
    if reserved is None:
        return ""
    outside = reserved.timeline.outside_bytes
    n = reserved.retries_per_step
    on_mem = (f"where the line passes {format_bytes(reserved.allocator_bytes + outside)}, the allocator releases its "
              f"cache and retries: {n} retr{'ies' if n > 1 else 'y'} per step" if n else
              f"the line stays under {format_bytes(reserved.allocator_bytes + outside)}: no retries")
    return (f"The black line is the memory the CUDA caching allocator holds (reserved), simulated in the plan's mode "
            f"({mode_name(reserved.timeline.expandable_segments)}) with no memory limit, in the second step (the "
            f"first starts with an empty cache), with the {format_bytes(outside)} outside it (CUDA context, NCCL) "
            f"added; its peak is the summary's reserved figure. On a GPU of {format_bytes(reserved.mem_bytes)} the "
            f"allocator gets {format_bytes(reserved.allocator_bytes)} (--mem less what is outside it, less the "
            f"margin): {on_mem}.")
