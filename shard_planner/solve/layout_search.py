"""The layout search: how one model replica is split over ranks (parallel/mesh.py ``ModelSplit``: the
tensor-parallel degree today, pipeline stages next) as the outermost global choice. Each split is screened on
the trace of one rank of it, the promising ones searched in full, and the fastest plan that fits over all of
them is the answer.

    options = [LayoutOption(ModelSplit(), trace_tp1), LayoutOption(ModelSplit(tp=2), trace_tp2, styles)]
    result = plan_over_layouts(options, request)
    result.plan.layouts   # per split: its fastest plan's speed, peak and frontier, or why none fits

Every split runs the same solver (solve/planner.py ``plan_model``), which searches the data-parallel part of
the layout on that split's trace: FSDP (or HSDP) over the data-parallel ranks (``Mesh.dp_size`` of them),
each taking its own micro-batch, so a global batch divides by them (solve/accumulation.py). A trace is one
rank's numbers at one split (trace ``tp_size``), so the split cannot be a choice inside one search. The
plans are compared by samples per second over the whole cluster: at one global batch, the step time.
What a split needs beyond its trace travels in its option and becomes the request's (the tensor-parallel
styles: ``PlanRequest.tensor_parallel``); a new dimension of the split (pipeline stages) adds its field
there, and this search, its screen, its outcomes and the report's figure per layout take it unchanged.

[Note: Why a layout wins or loses]
  What tensor parallelism changes, per rank, against FSDP over the same GPUs: parameters, gradients and
  optimizer states hold the same bytes (split by tp, then sharded over gpus / tp); each unit's all-gather
  and reduce-scatter move 1/tp of the bytes over a group tp times smaller whose ranks stride by tp (a
  group that stays in a node at a small world may leave it); activations divide by tp except what the
  split regions gather (cost/tp_comm.py, trace/); every block adds its tensor-parallel collectives on
  the compute stream's critical path. A degree wins where FSDP's exposed all-gathers or activation memory
  (so a smaller micro-batch or checkpointing) cost more than those collectives, or where the global batch
  leaves fewer samples than GPUs (FSDP alone would need a micro-batch under one sample); it loses where
  FSDP already hides its communication. plan/points.py ``layout_lines`` gives the figures, for the summary.

[Note: Screening the layouts]
  A full search costs seconds per layout at scale (Llama 3 70B on 256 GPUs: 5-10 s each), so every layout is
  first screened (planner.py ``screen_degree``: at each micro-batch, plain FSDP and default prefetch, the
  heuristic cover, the uniform covers fastest first until one fits and the recipes, under a second; its answer's
  allocator retries priced as the search prices its own), and only the layouts whose screened speed is within
  ``SCREEN_MARGIN`` of the best screened one are searched in full, each search starting from its layout's
  screened plan (``PlanRequest.start_plans``: so a layout's answer is never slower than its screen; before,
  Llama 3 70B on 64 H100s at 80GB answered TP 2 1.9% slower than its screen, on the allocator's retries). The
  margin is the most the full search has been seen to gain over the screen, rounded up. With the recipes in the
  screen (solve/never_worse.py) it gains, at TP 1, 2, 4, 8: Llama 3 8B on 8 GPUs at 40GB 0.00%, +0.02%, +0.26%,
  +16.2% (TP 4 and 8 screened 14% and 39% behind); 70B on 64 GPUs at 80GB 0.00%, 0.00%, +0.01%, -0.03% (the
  simplification's trade); 70B on 256 GPUs (seq 8192, global batch 512) +0.08%, 0.00%, +1.68%, +1.20%; 405B on
  512 GPUs (seq 8192, global batch 256; TP 1 fits nothing) +0.38%, +0.14% and 0.00% at TP 2, 4, 8
  (benchmarks/bench_screen_margin.py -> reports/benchmarks/screen_margin.md). Hence 2%; before the recipes
  joined the screen it gained up to +3.1% and the margin was 4% (without the uniform covers the screen missed TP
  4's 70B answer by 8.5%: the full search ends on a uniform cover often). A layout screened out keeps its
  screened figures (``judged="screened"``: what a search would at least find) and the summary says so. A layout
  whose screen finds no plan is searched only when no layout's screen found one (the search may, where the
  screen does not). Options may arrive one by one (an iterator: the command's helpers trace the next layout
  while this process screens the last), screened already or not (:class:`Screened`), and with ``beside`` (the
  helpers) every layout to search but the best screened one runs there, at the same time as this process's
  search (cli/plan_degrees.py [Note: Two helpers for the degrees]).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from shard_planner.errors import InfeasibleError, UserError, first_line
from shard_planner.parallel.mesh import ModelSplit
from shard_planner.parallel.tensor_parallel import TensorParallel
from shard_planner.plan import Plan
from shard_planner.plan.points import LayoutOutcome
from shard_planner.solve.context import Checked
from shard_planner.solve.planner import plan_model, screen_degree
from shard_planner.solve.request import PlanRequest, PlanResult
from shard_planner.trace.types import ModelTrace

logger = logging.getLogger(__name__)

SCREEN_MARGIN = 0.02  # a layout screened this much slower than the best screened one is not searched in full


@dataclass(frozen=True)
class Screened:
    """A layout's screen: the fastest plan it judged that fits (None: none), with its allocator retries priced
    (planner.py ``screen_degree``), or why the layout cannot be planned (``error``)."""

    best: Checked | None = None
    error: UserError | None = None


def screen(trace: ModelTrace, request: PlanRequest) -> Screened:
    """``screen_degree``, a layout it refuses as :class:`Screened` ``error`` (module-level: the command's
    helper processes screen the layouts they trace)."""
    try:
        return Screened(best=screen_degree(trace, request))
    except (InfeasibleError, UserError) as e:
        return Screened(error=e)


@dataclass(frozen=True)
class LayoutOption:
    """One split of the model to search: the split, the trace of one rank of it, what else the split needs in
    the request (``tensor_parallel``: the styles of a split with tp > 1, None without), and its screen when
    it was screened already (None: :func:`plan_over_layouts` screens it)."""

    split: ModelSplit
    trace: ModelTrace
    tensor_parallel: TensorParallel | None = None
    screened: Screened | None = None

    def __post_init__(self):
        if self.trace.tp_size != self.split.tp:
            raise ValueError(f"a trace at TP {self.trace.tp_size} given for {self.split.label}")

    def request(self, request: PlanRequest, screened: Checked | None = None) -> PlanRequest:
        """``request`` at this split; the search starts from its screened plan when there is one."""
        return replace(request, tensor_parallel=self.tensor_parallel,
                       start_plans=(screened.plan,) if screened is not None else ())


# ``beside(plan_model, trace, request)``: the call started elsewhere (cli/background.py Helper.submit), with
# a ``result()`` that waits for it and returns plan_model's answer or raises its exception
Beside = Callable[..., Any]


def plan_over_layouts(options: Iterable[LayoutOption], request: PlanRequest, *,
                      refused: tuple[LayoutOutcome, ...] = (), beside: Beside | None = None,
                      while_waiting: Callable[[], None] | None = None) -> PlanResult:
    """The fastest plan over ``options``' splits, its ``layouts`` every split's outcome (``refused``: the
    splits ruled out before tracing, e.g. by a dimension they do not divide; ``while_waiting``: called once
    this process's own search is done, before it waits for those ``beside``). Each split searched in full
    ([Note: Screening the layouts]) keeps its fastest plan's figures and its frontier in its outcome (the
    report draws them beside the answer's). A split that cannot be planned (no plan fits; a global batch
    its data-parallel ranks do not divide) is an outcome; all of them raise the first one's error."""
    outcomes: dict[ModelSplit, LayoutOutcome] = {o.split: o for o in refused}
    errors: list[UserError] = []
    screened: dict[ModelSplit, Checked | None] = {}
    by_split: dict[ModelSplit, LayoutOption] = {}
    screen_s = 0.0
    for opt in options:
        by_split[opt.split] = opt
        t0 = time.perf_counter()
        found = opt.screened if opt.screened is not None else screen(opt.trace, opt.request(request))
        screen_s += time.perf_counter() - t0
        if found.error is not None:
            errors.append(found.error)
            outcomes[opt.split] = LayoutOutcome(opt.split, judged="refused", refused=first_line(found.error))
        else:
            screened[opt.split] = found.best
    to_search = _worth_searching(screened)
    for split, c in screened.items():
        if split not in to_search and c is not None:
            outcomes[split] = _screened_outcome(split, c)
    searches = {s: (by_split[s].trace, by_split[s].request(request, screened.get(s))) for s in to_search}
    results = _search(searches, beside, outcomes, errors, while_waiting)
    if not results:
        if errors:
            raise errors[0]
        raise UserError("no layout (tensor-parallel degree) to plan: "
                        + "; ".join(f"{o.label}: {o.refused}" for o in refused))
    best = max(results, key=lambda r: r.plan.predicted.samples_per_s)
    timings = replace(best.timings, layouts_screened=len(by_split), layout_screen_s=screen_s,
                      layouts_searched=len(to_search))
    return replace(best, plan=replace(best.plan, layouts=tuple(outcomes[s] for s in sorted(outcomes))),
                   timings=timings)


def _worth_searching(screened: dict[ModelSplit, Checked | None]) -> list[ModelSplit]:
    """The splits to search in full, the best screened first ([Note: Screening the layouts])."""
    found = {s: c for s, c in screened.items() if c is not None}
    if not found:
        return list(screened)
    top = max(c.samples_per_s for c in found.values())
    kept = [s for s, c in found.items() if c.samples_per_s >= top * (1 - SCREEN_MARGIN)]
    return sorted(kept, key=lambda s: -found[s].samples_per_s)


def _search(searches: dict[ModelSplit, tuple[ModelTrace, PlanRequest]], beside: Beside | None,
            outcomes: dict[ModelSplit, LayoutOutcome], errors: list[UserError],
            while_waiting: Callable[[], None] | None = None) -> list[PlanResult]:
    """``plan_model`` for each split of ``searches`` (its trace and request, in order): the first here, the
    others ``beside`` when given (started before this process's own search, so that they run at the same time,
    ``while_waiting`` called between this process's search and the wait for theirs); each outcome recorded."""
    splits = list(searches)
    started = {s: beside(plan_model, *searches[s]) for s in splits[1:]} if beside is not None else {}
    results = []
    for s in splits:
        try:
            r = started[s].result() if s in started else plan_model(*searches[s])
        except (InfeasibleError, UserError) as e:
            errors.append(e)
            outcomes[s] = LayoutOutcome(s, judged="refused", refused=first_line(e))
            logger.info("%s: %s", s.label, first_line(e))
            continue
        results.append(r)
        outcomes[s] = _solved_outcome(r)
        if s == splits[0] and started and while_waiting is not None:
            while_waiting()
    return results


def _solved_outcome(r: PlanResult) -> LayoutOutcome:
    p, t = r.plan.predicted, r.estimate.time
    return LayoutOutcome(r.plan.mesh.split, "solved", p.step_time_s, p.samples_per_s, p.peak_bytes, t.compute_s,
                         t.exposed_comm_s, t.tp_comm_s, r.plan.global_batch_samples, r.plan.frontier,
                         fastest_plan=_fastest_plan(r.plan))


def _screened_outcome(split: ModelSplit, c: Checked) -> LayoutOutcome:
    t = c.estimate.time
    return LayoutOutcome(split, "screened", c.step_time_s, c.samples_per_s, c.peak_bytes, t.compute_s,
                         t.exposed_comm_s, t.tp_comm_s, c.plan.global_batch_samples, fastest_plan=_fastest_plan(c.plan))


def _fastest_plan(plan: Plan) -> str:
    """'FSDP 64 x TP 4, micro-batch 1 x 8 micro-steps, 81 of 82 units checkpointed'."""
    tr = plan.training
    steps = f" x {tr.accumulation_steps} micro-steps" if tr.accumulation_steps > 1 else ""
    checkpointed = sum(1 for u in plan.units if u.activation_checkpoint)
    return (f"{plan.mesh.description}, micro-batch {tr.micro_batch}{steps}, {checkpointed} of {len(plan.units)} "
            "units checkpointed")
