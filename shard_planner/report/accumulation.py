"""Gradient accumulation in the report: the micro-steps of the memory timeline and what they hold.

The cost model simulates an accumulated optimizer step as its first, one middle (standing for micro-steps
2..n-1) and its last micro-step (cost/accumulation.py), and labels each timeline event
``micro-step k/n ...``. The memory timeline marks where each simulated micro-step starts and writes,
at the start of each later one, the gradients held from the micro-steps before it: with gradient sync
deferred to the last micro-step these are every unit's unsharded gradients in the reduce dtype (the
"gradients" band steps up in micro-step 1 and stays), with sync every micro-step only the sharded ones.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from shard_planner.cost.types import MemoryEvent
from shard_planner.units import format_bytes

logger = logging.getLogger(__name__)

_MICRO_STEP = re.compile(r"micro-step (\d+)/(\d+) ")


def micro_step_spans(events: Sequence[MemoryEvent]) -> list[tuple[int, int, int, int]]:
    """(micro-step number, of n, first event index, last event index) per simulated micro-step, in
    order; [] for a timeline without accumulation."""
    spans: list[tuple[int, int, int, int]] = []
    for i, e in enumerate(events):
        m = _MICRO_STEP.match(e.label)
        if m is None:
            return []
        k, n = int(m.group(1)), int(m.group(2))
        if spans and spans[-1][0] == k:
            spans[-1] = (k, n, spans[-1][2], i)
        else:
            spans.append((k, n, i, i))
    return spans


def held_gradient_bytes(events: Sequence[MemoryEvent]) -> list[tuple[int, int]]:
    """(first event index, gradient bytes live there) at the start of every simulated micro-step after the
    first: what the micro-steps before it left (see the module docstring)."""
    return [(lo, events[lo].bytes_by_category.get("grads", 0)) for _, _, lo, _ in micro_step_spans(events)[1:]]


def draw_micro_steps(ax, events: Sequence[MemoryEvent], scale: float) -> None:
    """Mark each simulated micro-step of ``events`` on ``ax`` (the memory timeline): a line where it
    starts (gid "micro-step:<k>"), its name in the band along the top of the axes, left-aligned at its start,
    with the gradients held at its start under the name and as a dot on the stack (gid "held:<k>")."""
    spans = micro_step_spans(events)
    if not spans:
        return
    held = dict(held_gradient_bytes(events))
    n = spans[0][1]
    middle = f"; micro-step 2 stands for 2..{n - 1}" if n > 3 else ""
    ax.set_xlabel(f"event in one optimizer step of {n} micro-steps (index, in execution order{middle})")
    for k, n, lo, hi in spans:
        name = f"micro-step {k}/{n}" if k in (1, n) or n == 3 else f"micro-steps 2..{n - 1} of {n}"
        if lo:
            ax.axvline(lo - 0.5, color="#555555", ls="--", lw=0.8, zorder=3, gid=f"micro-step:{k}")
        if lo in held:
            name += f"\ngradients held: {format_bytes(held[lo])}"
            ax.plot([lo - 0.5], [held[lo] / scale], marker="o", ms=4, color="#222222", zorder=6, ls="none",
                    gid=f"held:{k}")
        ax.text(lo - 0.3, 0.985, name, transform=ax.get_xaxis_transform(), ha="left", va="top", fontsize=8,
                color="#333333", zorder=6, gid=f"micro-step-name:{k}")
