"""The memory timeline of the chosen plan: live bytes per rank after each event of one step, stacked by
category, with the peak, the budget lines, the phases, the micro-steps of an accumulated step
(report/accumulation.py) and, on a GPU, the simulated allocator's reserved bytes (report/reserved.py).

Every name on the plot is in the legend (phases as their shades, the peak with its event, the budget
lines, the reserved line with its peak) or in the band along the top of the axes (the micro-steps, each
left-aligned at its start): nothing is written over the data, so no label can hide a line or run into
another. The y axis is zoomed to the data when the budget is far above it (report/plots.py [Note: Zoom to
the data]). Artists carry gids: "stack", "peak", "phase:<name>", "budget", "usable-budget",
"budget-off-scale", "reserved", "micro-step:<k>", "held:<k>".
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from shard_planner.cost.schedule import Phase
from shard_planner.cost.types import MemoryEstimate
from shard_planner.plan import MEMORY_CATEGORIES
from shard_planner.report.accumulation import draw_micro_steps
from shard_planner.report.budget import ReportBudget
from shard_planner.report.plots import (
    CATEGORY_COLORS, CATEGORY_LABELS, _wrap, budget_on_scale, byte_scale, draw_budget,
)
from shard_planner.report.reserved import ReservedLine, draw_reserved
from shard_planner.units import format_bytes

PHASE_SHADES = {Phase.FORWARD: "#e8f1fa", Phase.BACKWARD: "#fdf0e6", Phase.OPTIMIZER: "#eaf5ea"}
PHASE_NAMES = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.OPTIMIZER: "optimizer step"}
HEADROOM = 1.22  # the y axis ends this far above the highest figure drawn: room for the top band's names


def phase_spans(phases: Sequence[str]) -> list[tuple[str, int, int]]:
    """Contiguous runs of one phase: (phase, first index, last index)."""
    spans: list[tuple[str, int, int]] = []
    for i, ph in enumerate(phases):
        if spans and spans[-1][0] == ph:
            spans[-1] = (ph, spans[-1][1], i)
        else:
            spans.append((ph, i, i))
    return spans


def plot_memory_timeline(memory: MemoryEstimate, budget: ReportBudget, title: str = "",
                         reserved: ReservedLine | None = None, *, labels: dict[str, str] = CATEGORY_LABELS) -> Figure:
    """Live bytes per rank after each event of one step, stacked by category (module docstring), each named by
    ``labels`` (report/plots.py ``category_labels``: as the plan's engine holds it)."""
    events = memory.timeline
    n = len(events)
    cats = [c for c in MEMORY_CATEGORIES if any(e.bytes_by_category.get(c, 0) for e in events)]
    data_top = max([memory.peak_bytes, reserved.peak_total_bytes if reserved else 0]
                   + [e.total_bytes for e in events])
    on_scale = budget_on_scale(data_top, budget)
    top_bytes = max(data_top, budget.mem_bytes, budget.usable_bytes) if on_scale else data_top
    scale, unit = byte_scale(top_bytes)
    # Memory is constant between events: draw each event as a step one unit wide centred on its index.
    xs = [x for i in range(n) for x in (i - 0.5, i + 0.5)]
    fig = Figure(figsize=(11, 5.4), layout="constrained")
    ax = fig.add_subplot()

    named = set()
    for ph, lo, hi in phase_spans([e.phase for e in events]):
        label = PHASE_NAMES.get(ph, str(ph)) + " (shaded)" if ph not in named else None
        named.add(ph)
        ax.axvspan(lo - 0.5, hi + 0.5, color=PHASE_SHADES.get(ph, "#f2f2f2"), zorder=0, lw=0, label=label,
                   gid=f"phase:{PHASE_NAMES.get(ph, ph)}")
    ax.stackplot(xs, [[e.bytes_by_category.get(c, 0) / scale for e in events for _ in (0, 1)] for c in cats],
                 labels=[labels[c] for c in cats], colors=[CATEGORY_COLORS[c] for c in cats],
                 alpha=0.9, zorder=2, gid="stack")
    ax.set_ylim(0, top_bytes / scale * HEADROOM)
    ax.set_xlim(-0.5, n - 0.5)

    peak_i = max(range(n), key=lambda i: events[i].total_bytes) if n else 0
    peak_y = events[peak_i].total_bytes / scale if n else memory.peak_bytes / scale
    ax.plot([peak_i], [peak_y], marker="v", color="black", ms=9, zorder=5, ls="none", gid="peak",
            label=_wrap(f"peak {format_bytes(memory.peak_bytes)} allocated, at {memory.peak_event}"))
    draw_budget(ax, budget, scale, vertical=False, on_scale=on_scale)
    draw_reserved(ax, events, reserved, scale)  # on a GPU: report/reserved.py
    ax.set_xlabel("event in one training step (index, in execution order)")
    draw_micro_steps(ax, events, scale)  # gradient accumulation: report/accumulation.py
    ax.set_ylabel(f"live memory per {budget.rank_word} ({unit})")
    ax.set_title(title or "Memory over one training step (predicted)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    return fig
