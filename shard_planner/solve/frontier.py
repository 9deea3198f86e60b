"""The memory-vs-time frontier: a budget sweep at the chosen global choice (:func:`sweep`), and the
Pareto set of every plan the simulators judged (:func:`pareto`)."""

from __future__ import annotations

import logging

from shard_planner.plan import FrontierPoint
from shard_planner.solve import cpsat
from shard_planner.solve.context import Checked, PlanContext
from shard_planner.solve.describe import describe_choice
from shard_planner.solve.linear import evaluate
from shard_planner.solve.survive import priced_step_time_s

logger = logging.getLogger(__name__)

# The frontier's smallest-peak point is for the plot first (the answer is solved at the budget): it gets
# this share of the per-solve time limit.
FRONTIER_TIME_SHARE = 0.25


def start_sweep(ctx: PlanContext, choice) -> None:
    """Start the sweep's smallest-peak solve at ``choice`` (the screen's pick, usually the answer's
    choice) on the second core ([Note: a solve ahead] in solve/context.py)."""
    ctx.min_peak_ahead(ctx.linear(choice), ctx.time_limit_s * FRONTIER_TIME_SHARE)


def sweep(ctx: PlanContext, best: Checked, points: int) -> list[Checked]:
    """Plans at ``points`` budgets from the smallest peak to that of the fastest cover, at the chosen
    global choice, each checked with the simulators: they are for the frontier's plot first (the
    answer was solved at the budget), though the simulators may find one of them faster than the
    answer. The ends are exact or bounded: the smallest linear peak (CP-SAT, ``FRONTIER_TIME_SHARE``
    of the time limit; the frugal cover when out of time) and the fastest cover with no memory limit
    (a shortest path, :func:`cpsat.fastest_cover`); the inner points are the heuristic covers at their
    budgets (:func:`cpsat.greedy_cover`, milliseconds, where a CP-SAT solve each cost 0.4-1 s of CPU on
    Llama 8B-70B and, at a quarter of the time limit, mostly returned that hint anyway)."""
    lm = ctx.linear(best.choice)
    evaluated = []
    low = ctx.min_peak(lm, ctx.time_limit_s * FRONTIER_TIME_SHARE)
    if low.chosen is not None:
        evaluated.append(ctx.check(lm, low.chosen, low.status))
    with ctx.clock.doing("hints"):
        fastest = cpsat.fastest_cover(lm)
    evaluated.append(ctx.check(lm, fastest, "OPTIMAL (no memory limit: a shortest path)"))
    if low.chosen is not None and points > 2:
        lo, hi = low.objective, evaluate(lm, fastest).peak_mib
        for j in range(1, points - 1):
            b = lo + (hi - lo) * j // (points - 1)
            cover = ctx.greedy(lm, b)
            if cover is not None:
                evaluated.append(ctx.check(lm, cover, f"heuristic cover at {b} MiB (linear model)"))
    return evaluated


def pareto(ctx: PlanContext, evaluated: list[Checked]) -> list[FrontierPoint]:
    """The Pareto set of (peak, step time) by the simulators' numbers over every plan evaluated, each point's
    allocator retries priced in its step time (solve/survive.py [Note: Ranked by the priced time]): the set
    by the unpriced times, then, priced, the points another point of it now beats (smaller and faster)
    dropped. Pricing every plan judged would take the allocator's simulation of each, so a plan off the
    unpriced set is not brought back by its price."""
    front: list[Checked] = []
    for c in sorted(evaluated, key=lambda c: (c.peak_bytes, c.step_time_s)):
        if not front or c.step_time_s < front[-1].step_time_s:
            front.append(c)
    priced: list[tuple[Checked, float]] = []
    for c in front:  # in peak order: a point stays when it is faster, priced, than every smaller one kept
        step_s = priced_step_time_s(ctx, c)
        if not priced or step_s < priced[-1][1]:
            priced.append((c, step_s))
    return [FrontierPoint(peak_bytes=c.peak_bytes, step_time_s=step_s,
                          description=(c.status + ": " if c.method in ("recipe", "no-wrapping") else "")
                          + describe_choice(c.units, c.choice), fits=ctx.shown_fits(c))
            for c, step_s in priced]
