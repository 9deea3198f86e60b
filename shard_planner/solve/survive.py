"""The planner's answer judged on the GPU it is for, and solved again when it would run out of memory there.

    plan_surviving(trace, request, plan_at_budget) -> PlanResult      # solve/planner.py plan_model calls it
    surviving_choice(ctx, chosen, pool, status) -> (Checked, status)  # inside one search: a runner-up that survives

[Note: Search by the allocated peak, judge by the allocator]
  The solver compares hundreds of plans by their allocated peak (the linear model, then the simulators:
  milliseconds each) against ``profile.tensor_budget_bytes(--mem)``. On a GPU profile that is --mem x
  ``usable_fraction``, about the most a plan that survives can allocate: the allocator reserves at least what
  it hands out, and gets ``usable_fraction`` of --mem less the memory outside it (cost/fits.py [Note: The
  margin on a GPU]). What fits on a GPU is decided by the caching-allocator simulation of the first two
  steps (cost/fits.py [Note: What fits means on a GPU]), 3-50 ms a plan, so it judges what the planner shows:
  its answer, here, and the frontier and hand-written points (solve/context.py ``shown_fits``). When the
  answer does not survive, the plans the search already judged are tried next, the fastest first, at most
  ``RUNNERS_UP_JUDGED`` of them (:func:`surviving_choice`: the smallest-peak plans of the frontier sweep are
  among them, which a tighter budget would not reach when they tie in peak with faster ones). When none
  survives, the search runs again with the allocated budget lowered below the answer's peak
  by what the allocator lacked: the smallest memory its steps survive less the memory it had
  (cost/fits.py ``smallest_surviving_bytes``, a bisection of 2-12 simulations), plus ``MIN_TIGHTEN_FRACTION``
  of the budget per round so far (the next answer is another plan, which may waste more; the way
  tune/candidates.py re-solves at budgets below a plan's peak), at most ``MAX_RESOLVES`` times. The solver's
  status says how often and why; the seconds of every round count in ``solver.seconds`` and in the timings'
  ``other_s`` / ``total_s``. When no round survives, :class:`InfeasibleError` says what ran out and where.
  A plan that survives only with retries is an answer, says so, and its predicted step time includes their
  price (cost/fits.py [Note: Retries are priced]).

[Note: Ranked by the priced time]
  The search ranks plans by the cost model's step time, without the retries' price (it would need the
  allocator's simulation of every plan it judges). Its answer is priced; when it retries, the plans the
  search judged are priced too, the fastest unpriced first, until the next one is no faster unpriced than
  the best priced so far (a price only adds time), and the fastest priced is the answer. Llama 3 8B on 8
  H100s at --mem 40GB (the README's command, degree 1): the search's answer ran 4 retries per step costing
  134 ms (+21%, 777.5 ms priced); a plan it judged with a smaller peak runs 699.6 ms with its one retry.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Callable

from shard_planner.cost.fits import smallest_surviving_bytes
from shard_planner.cost.model import CostModel
from shard_planner.errors import InfeasibleError
from shard_planner.solve.context import Checked, PlanContext, speed
from shard_planner.solve.request import PlanRequest, PlanResult
from shard_planner.trace.types import ModelTrace
from shard_planner.units import format_bytes

logger = logging.getLogger(__name__)

MAX_RESOLVES = 3  # searches after the first, each at a tighter allocated budget
# plans of one search judged by the allocator (3-50 ms each) when its answer does not survive, or survives
# only with retries
RUNNERS_UP_JUDGED = 32
MIN_TIGHTEN_FRACTION = 0.01  # of the allocated budget: the least a re-solve lowers it by


def plan_surviving(trace: ModelTrace, request: PlanRequest,
                   plan_at_budget: Callable[[ModelTrace, PlanRequest], PlanResult]) -> PlanResult:
    """``plan_at_budget(trace, request)``'s answer when it survives --mem in the allocator simulation (always
    on a CPU profile, where ``PlanResult.fit`` is None), else the answer of a search at a tighter allocated
    budget that does, at most ``MAX_RESOLVES`` more searches. See [Note: Search by the allocated peak, judge
    by the allocator]."""
    result = plan_at_budget(trace, request)
    rejected: list[tuple[PlanResult, int]] = []  # each answer that ran out of memory, and what it lacked
    empty_at: tuple[int, str] | None = None  # the largest allocated budget a search found no plan at, and why
    while result is None or not (result.fit is None or result.fit.survives):
        if result is not None:
            gap = smallest_surviving_bytes(CostModel(trace, request.profile), result.plan, result.fit)
            rejected.append((result, gap - result.fit.allocator_bytes))
        budget = _next_budget(request, rejected, empty_at)
        searches = len(rejected) + (empty_at is not None)
        if searches > MAX_RESOLVES or budget is None:
            why = empty_at[1] if empty_at else f"{MAX_RESOLVES} tighter searches found none"
            raise InfeasibleError(_none_survives(rejected, why))
        logger.info("the answer runs out of memory in the simulated allocator: searching again at an allocated "
                    "budget of %s", format_bytes(budget))
        try:
            result = plan_at_budget(trace, replace(request, allocated_budget_bytes=budget))
        except InfeasibleError as exc:
            result, empty_at = None, (budget, str(exc))
    return _with_rounds(result, rejected) if rejected else result


def surviving_choice(ctx: PlanContext, chosen: Checked, pool: list[Checked], status: str) -> tuple[Checked, str]:
    """``chosen`` when it survives --mem in the allocator simulation without retries (or on a CPU profile);
    else the fastest, with the retries' price in its step time, of ``chosen`` (when it survives) and the plans
    of ``pool`` (this search's, within its budget) that survive: judged the fastest unpriced first, until one
    that unpriced is no faster than the best priced so far, at most ``RUNNERS_UP_JUDGED``; the status says
    why. ``chosen`` again when none survives
    (:func:`plan_surviving` searches again). See [Note: Ranked by the priced time]."""
    fit = ctx.device_fit(chosen.plan)
    if fit is None or (fit.survives and fit.retry_s == 0):
        return chosen, status
    best, best_speed = (chosen, _priced_speed(chosen, fit)) if fit.survives else (None, 0.0)
    runners_up = sorted((c for c in pool if c.plan != chosen.plan), key=speed, reverse=True)
    for judged, c in enumerate(runners_up):
        if judged >= RUNNERS_UP_JUDGED or c.samples_per_s <= best_speed:
            break  # the price only slows a plan: one no faster unpriced cannot win
        c_fit = ctx.device_fit(c.plan)
        if c_fit.survives and _priced_speed(c, c_fit) > best_speed:
            best, best_speed = c, _priced_speed(c, c_fit)
    if best is None or best is chosen:
        return chosen, status
    change = f"{100 * (best.step_time_s / chosen.step_time_s - 1):+.1f}% step time"
    if not fit.survives:
        return best, (f"{best.status}; the search's answer ran out of memory in the simulated allocator at "
                      f"\"{fit.oom_at}\": the fastest plan it judged that survives, {change}")
    return best, (f"{best.status}; the search's answer survives only with {fit.retries_per_step} allocator "
                  f"retries per step ({fit.retry_s * 1e3:.3g} ms): with their price, a plan it judged is faster "
                  f"({change} before the price)")


def priced_step_time_s(ctx: PlanContext, c: Checked) -> float:
    """``c``'s step time as the planner shows it (the frontier, the recipes): with the price of
    its allocator retries when it survives --mem only with them (on a GPU profile)."""
    fit = ctx.device_fit(c.plan)
    return c.step_time_s + (fit.retry_s if fit is not None and fit.survives else 0.0)


def _priced_speed(c: Checked, fit) -> float:
    """``c``'s samples per second with its retries' price in the step (cost/fits.py [Note: Retries are priced])."""
    return c.samples_per_s * c.step_time_s / (c.step_time_s + fit.retry_s)


def _next_budget(request: PlanRequest, rejected: list[tuple[PlanResult, int]], empty_at: tuple[int, str] | None):
    """The allocated budget of the next search: below the smallest peak that ran out of memory by what its
    allocator lacked, and ``MIN_TIGHTEN_FRACTION`` of the budget per round so far; once a search found no
    plan at all, halfway between that budget and the smallest failing peak (None: nothing left between)."""
    start = request.profile.tensor_budget_bytes(request.mem_budget_bytes)
    failing, gap = min(((r.plan.predicted.peak_bytes, g) for r, g in rejected), default=(start, 0))
    if empty_at is not None:
        budget = (empty_at[0] + failing) // 2
        return budget if empty_at[0] < budget < failing else None
    return max(1, failing - gap - int(start * MIN_TIGHTEN_FRACTION * len(rejected)))


def _with_rounds(result: PlanResult, rejected: list[tuple[PlanResult, int]]) -> PlanResult:
    """``result`` with the earlier answers' seconds counted and the solver's status saying why they ran
    (the seconds of a search that found no plan are not known here: they are left out)."""
    first, gap = rejected[0]
    earlier_s = sum(r.timings.total_s for r, _ in rejected)
    n = len(rejected)
    note = (f"the first answer (peak {format_bytes(first.plan.predicted.peak_bytes)}) ran out of memory in the "
            f"simulated allocator at \"{first.fit.oom_at}\" (it needs {format_bytes(gap)} more than "
            f"{format_bytes(first.fit.allocator_bytes)}){f', and {n - 1} more answers' if n > 1 else ''}: this is "
            f"the answer of a search at a tighter allocated budget (peak {format_bytes(result.plan.predicted.peak_bytes)})")
    solver = result.plan.solver
    plan = replace(result.plan, solver=replace(solver, status=f"{solver.status}; {note}",
                                               seconds=solver.seconds + earlier_s))
    timings = replace(result.timings, other_s=result.timings.other_s + earlier_s,
                      total_s=result.timings.total_s + earlier_s)
    return replace(result, plan=plan, timings=timings)


def _none_survives(rejected: list[tuple[PlanResult, int]], why: str) -> str:
    last, gap = rejected[-1]
    fit = last.fit
    need = fit.outside_bytes + math.ceil((fit.allocator_bytes + gap) / fit.usable_fraction)
    return (f"no plan found survives --mem {format_bytes(fit.mem_bytes)} in the simulated CUDA caching allocator: "
            f"the fastest at an allocated peak of {format_bytes(last.plan.predicted.peak_bytes)} runs out of memory "
            f"at \"{fit.oom_at}\" on {format_bytes(fit.allocator_bytes)} for the allocator (it needs "
            f"{format_bytes(gap)} more: --mem {format_bytes(need)} with the margin), and at tighter budgets: {why}")
