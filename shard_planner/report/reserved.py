"""The CUDA caching allocator in the report: the memory it holds (reserved) beside the memory it hands out.

On a GPU profile the memory timeline draws, over the stack of allocated bytes by category, the reserved
bytes the caching-allocator simulation holds at every event of the step (cost/reserved.py
``simulate_reserved_timeline``: the second step, the steady state), in the plan's allocator mode, on the
memory the plan was judged to fit on (cost/fits.py: --mem less what is outside the allocator, less the
margin), with the profile's outside bytes (CUDA context, NCCL) added so that it compares with the stack,
which counts them as "overhead". Where it drops, the allocator released its cache to retry an allocation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from shard_planner.allocator_conf import mode_name
from shard_planner.cost.reserved import ReservedTimeline
from shard_planner.cost.types import MemoryEvent
from shard_planner.plan import Plan
from shard_planner.units import format_bytes

logger = logging.getLogger(__name__)

RESERVED_COLOR = "#111111"


def reserved_timeline(plan: Plan, trace, profile) -> ReservedTimeline | None:
    """The simulated allocator over ``plan``'s step on the memory it was judged to fit on (None without a
    trace, or on a CPU profile)."""
    if trace is None or profile is None or profile.device != "cuda":
        return None
    from shard_planner.cost import CostModel  # imported late, as the report's estimate is
    from shard_planner.cost.fits import device_fit

    cm = CostModel(trace, profile)
    fit = device_fit(cm, plan)
    return cm.reserved_timeline(plan, plan.cluster.expandable_segments, device_bytes=fit.allocator_bytes)


def draw_reserved(ax, events: Sequence[MemoryEvent], reserved: ReservedTimeline | None, scale: float,
                  unit: str) -> None:
    """The reserved bytes (outside bytes added) as a line over the timeline's stack, one step per event
    (gid "reserved"); nothing when the simulation's marks do not match the timeline's events."""
    if reserved is None or not reserved.marks:
        return
    marks = reserved.marks
    if len(marks) > len(events):
        logger.warning("the allocator simulation has %d marks for %d timeline events: no reserved line",
                       len(marks), len(events))
        return
    ys = [(m[4] + reserved.outside_bytes) / scale for m in marks for _ in (0, 1)]
    xs = [x for i in range(len(marks)) for x in (i - 0.5, i + 0.5)]
    peak = max(m[4] for m in marks) + reserved.outside_bytes
    ran_out = " (out of memory after this)" if len(marks) < len(events) else ""
    ax.plot(xs, ys, color=RESERVED_COLOR, lw=1.3, zorder=4, gid="reserved",
            label=f"reserved (CUDA caching allocator, simulated), peak {peak / scale:.2f} {unit}{ran_out}")


def reserved_caption(reserved: ReservedTimeline | None) -> str:
    """What the reserved line is, for the memory section's caption ("" without one)."""
    if reserved is None:
        return ""
    return (f"The black line is the memory the CUDA caching allocator holds (reserved), simulated in the plan's mode "
            f"({mode_name(reserved.expandable_segments)}) on the {format_bytes(reserved.device_bytes)} the plan was "
            f"judged to fit on (--mem less {format_bytes(reserved.outside_bytes)} outside the allocator, less the "
            "margin), in the second step (the first starts with an empty cache), with the memory outside it added; "
            "where it drops, the allocator released its cache to retry an allocation.")
