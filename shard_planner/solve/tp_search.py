"""The tensor-parallel degree as the outermost global choice: each degree screened on the trace of one rank at
that degree, the promising ones searched in full, and the fastest plan that fits over all of them.

    result = plan_over_degrees([DegreeOption(None, trace_tp1), DegreeOption(styles, trace_tp2)], request)
    result.plan.tp_degrees   # per degree: its fastest plan's speed, peak and frontier, or why none fits

Every degree runs the same solver (solve/planner.py ``plan_model``): its meshes are FSDP (or HSDP) over the
data-parallel ranks, ``gpus / tp`` of them, each taking its own micro-batch, so a global batch divides by
them (solve/accumulation.py). A trace is one rank's numbers at one degree (trace ``tp_size``), so the
degree cannot be a choice inside one search. The plans are compared by samples per second over the whole
cluster: at one global batch, the step time.

[Note: Why a degree wins or loses]
  What tensor parallelism changes, per rank, against FSDP over the same GPUs: parameters, gradients and
  optimizer states hold the same bytes (split by tp, then sharded over gpus / tp); each unit's all-gather
  and reduce-scatter move 1/tp of the bytes over a group tp times smaller whose ranks stride by tp (a
  group that stays in a node at a small world may leave it); activations divide by tp except what the
  split regions gather (cost/tp_comm.py, trace/); every block adds its tensor-parallel collectives on
  the compute stream's critical path. A degree wins where FSDP's exposed all-gathers or activation memory
  (so a smaller micro-batch or checkpointing) cost more than those collectives, or where the global batch
  leaves fewer samples than GPUs (FSDP alone would need a micro-batch under one sample); it loses where
  FSDP already hides its communication. plan_points.degree_lines gives the figures, for the summary.

[Note: Screening the degrees]
  A full search costs seconds per degree at scale (Llama 3 70B on 256 GPUs: 5-10 s each), so every degree is
  first screened (planner.py ``screen_degree``: at each micro-batch, plain FSDP and default prefetch, the
  heuristic cover, the uniform covers fastest first until one fits and the recipes, under a second; its answer's
  allocator retries priced as the search prices its own), and only the degrees whose screened speed is within
  ``SCREEN_MARGIN`` of the best screened one are searched in full, each search starting from its degree's
  screened plan (``PlanRequest.start_plans``: so a degree's answer is never slower than its screen; before,
  Llama 3 70B on 64 H100s at 80GB answered TP 2 1.9% slower than its screen, on the allocator's retries). The
  margin is the most the full search has been seen to gain over the screen, rounded up. With the recipes in the
  screen (solve/never_worse.py) it gains, at TP 1, 2, 4, 8: Llama 3 8B on 8 GPUs at 40GB 0.00%, +0.02%, +0.26%,
  +16.2% (TP 4 and 8 screened 14% and 39% behind); 70B on 64 GPUs at 80GB 0.00%, 0.00%, +0.01%, -0.03% (the
  simplification's trade); 70B on 256 GPUs (seq 8192, global batch 512) +0.08%, 0.00%, +1.68%, +1.20%; 405B on
  512 GPUs (seq 8192, global batch 256; TP 1 fits nothing) +0.38%, +0.14% and 0.00% at TP 2, 4, 8
  (benchmarks/bench_screen_margin.py -> reports/benchmarks/screen_margin.md). Hence 2%; before the recipes
  joined the screen it gained up to +3.1% and the margin was 4% (without the uniform covers the screen missed TP
  4's 70B answer by 8.5%: the full search ends on a uniform cover often). A degree screened out keeps its
  screened figures (``judged="screened"``: what a search would at least find) and the summary says so. A degree
  whose screen finds no plan is searched only when no degree's screen found one (the search may, where the
  screen does not). Options may arrive one by one (an iterator: the command's helpers trace the next degree
  while this process screens the last), screened already or not (:class:`Screened`), and with ``beside`` (the
  helpers) every degree to search but the best screened one runs there, at the same time as this process's
  search (cli/plan_degrees.py [Note: Two helpers for the degrees]).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from shard_planner.errors import InfeasibleError, UserError, first_line
from shard_planner.plan import Plan
from shard_planner.plan.points import DegreeOutcome, degree_label
from shard_planner.solve.context import Checked
from shard_planner.solve.planner import plan_model, screen_degree
from shard_planner.solve.request import PlanRequest, PlanResult
from shard_planner.parallel.tensor_parallel import TensorParallel
from shard_planner.trace.types import ModelTrace

logger = logging.getLogger(__name__)

SCREEN_MARGIN = 0.02  # a degree screened this much slower than the best screened one is not searched in full


@dataclass(frozen=True)
class Screened:
    """A degree's screen: the fastest plan it judged that fits (None: none), with its allocator retries priced
    (planner.py ``screen_degree``), or why the degree cannot be planned (``error``)."""

    best: Checked | None = None
    error: UserError | None = None


def screen(trace: ModelTrace, request: PlanRequest) -> Screened:
    """``screen_degree``, a degree it refuses as :class:`Screened` ``error`` (module-level: the command's
    helper processes screen the degrees they trace)."""
    try:
        return Screened(best=screen_degree(trace, request))
    except (InfeasibleError, UserError) as e:
        return Screened(error=e)


@dataclass(frozen=True)
class DegreeOption:
    """One tensor-parallel degree to search: its styles (None at degree 1), the trace of one rank, and its
    screen when it was screened already (None: :func:`plan_over_degrees` screens it)."""

    tensor_parallel: TensorParallel | None
    trace: ModelTrace
    screened: Screened | None = None

    @property
    def degree(self) -> int:
        return self.trace.tp_size


# ``beside(plan_model, trace, request)``: the call started elsewhere (cli/background.py Helper.submit), with
# a ``result()`` that waits for it and returns plan_model's answer or raises its exception
Beside = Callable[..., Any]


def plan_over_degrees(options: Iterable[DegreeOption], request: PlanRequest, *,
                      refused: tuple[DegreeOutcome, ...] = (), beside: Beside | None = None) -> PlanResult:
    """The fastest plan over ``options``' degrees, its ``tp_degrees`` every degree's outcome (``refused``: the
    degrees ruled out before tracing, e.g. by a dimension they do not divide). Each degree searched in full
    ([Note: Screening the degrees]) keeps its fastest plan's figures and its frontier in its outcome (the
    report draws them beside the answer's). A degree that cannot be planned (no plan fits; a global batch
    its data-parallel ranks do not divide) is an outcome; all of them raise the first one's error."""
    outcomes: dict[int, DegreeOutcome] = {o.degree: o for o in refused}
    errors: list[UserError] = []
    screened: dict[int, Checked | None] = {}
    by_degree: dict[int, DegreeOption] = {}
    screen_s = 0.0
    for opt in options:
        by_degree[opt.degree] = opt
        t0 = time.perf_counter()
        found = opt.screened if opt.screened is not None else screen(opt.trace, _request_for(opt, request))
        screen_s += time.perf_counter() - t0
        if found.error is not None:
            errors.append(found.error)
            outcomes[opt.degree] = DegreeOutcome(opt.degree, judged="refused", refused=first_line(found.error))
        else:
            screened[opt.degree] = found.best
    to_search = _worth_searching(screened)
    for degree, c in screened.items():
        if degree not in to_search and c is not None:
            outcomes[degree] = _screened_outcome(degree, c)
    searches = {d: (by_degree[d].trace, _request_for(by_degree[d], request, screened.get(d))) for d in to_search}
    results = _search(searches, beside, outcomes, errors)
    if not results:
        if errors:
            raise errors[0]
        raise UserError("no tensor-parallel degree to plan: " + "; ".join(f"{o.label}: {o.refused}" for o in refused))
    best = max(results, key=lambda r: r.plan.predicted.samples_per_s)
    timings = replace(best.timings, degrees_screened=len(by_degree), degree_screen_s=screen_s,
                      degrees_searched=len(to_search))
    return replace(best, plan=replace(best.plan, tp_degrees=tuple(outcomes[d] for d in sorted(outcomes))),
                   timings=timings)


def _request_for(opt: DegreeOption, request: PlanRequest, screened: Checked | None = None) -> PlanRequest:
    """``request`` at ``opt``'s degree; the search starts from the degree's screened plan when there is one."""
    return replace(request, tensor_parallel=opt.tensor_parallel,
                   start_plans=(screened.plan,) if screened is not None else ())


def _worth_searching(screened: dict[int, Checked | None]) -> list[int]:
    """The degrees to search in full, the best screened first ([Note: Screening the degrees])."""
    found = {d: c for d, c in screened.items() if c is not None}
    if not found:
        return list(screened)
    top = max(c.samples_per_s for c in found.values())
    kept = [d for d, c in found.items() if c.samples_per_s >= top * (1 - SCREEN_MARGIN)]
    return sorted(kept, key=lambda d: -found[d].samples_per_s)


def _search(searches: dict[int, tuple[ModelTrace, PlanRequest]], beside: Beside | None,
            outcomes: dict[int, DegreeOutcome], errors: list[UserError]) -> list[PlanResult]:
    """``plan_model`` for each degree of ``searches`` (its trace and request, in order): the first here, the
    others ``beside`` when given (started before this process's own search, so that they run at the same time);
    each outcome recorded."""
    degrees = list(searches)
    started = {d: beside(plan_model, *searches[d]) for d in degrees[1:]} if beside is not None else {}
    results = []
    for d in degrees:
        try:
            r = started[d].result() if d in started else plan_model(*searches[d])
        except (InfeasibleError, UserError) as e:
            errors.append(e)
            outcomes[d] = DegreeOutcome(d, judged="refused", refused=first_line(e))
            logger.info("%s: %s", degree_label(d), first_line(e))
            continue
        results.append(r)
        outcomes[d] = _solved_outcome(r)
    return results


def _solved_outcome(r: PlanResult) -> DegreeOutcome:
    p, t = r.plan.predicted, r.estimate.time
    return DegreeOutcome(r.plan.mesh.tp, "solved", p.step_time_s, p.samples_per_s, p.peak_bytes, t.compute_s,
                         t.exposed_comm_s, t.tp_comm_s, r.plan.global_batch_samples, r.plan.frontier,
                         layout=_layout(r.plan))


def _screened_outcome(degree: int, c: Checked) -> DegreeOutcome:
    t = c.estimate.time
    return DegreeOutcome(degree, "screened", c.step_time_s, c.samples_per_s, c.peak_bytes, t.compute_s,
                         t.exposed_comm_s, t.tp_comm_s, c.plan.global_batch_samples, layout=_layout(c.plan))


def _layout(plan: Plan) -> str:
    """'FSDP 64 x TP 4, micro-batch 1 x 8 micro-steps, 81 of 82 units checkpointed'."""
    tr = plan.training
    steps = f" x {tr.accumulation_steps} micro-steps" if tr.accumulation_steps > 1 else ""
    checkpointed = sum(1 for u in plan.units if u.activation_checkpoint)
    return (f"{plan.mesh.description}, micro-batch {tr.micro_batch}{steps}, {checkpointed} of {len(plan.units)} "
            "units checkpointed")
