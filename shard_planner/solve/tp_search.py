"""The tensor-parallel degree as the outermost global choice: one plan search per degree, each on the trace
of one rank at that degree, and the fastest plan that fits over all of them.

    result = plan_over_degrees([DegreeOption(None, trace_tp1), DegreeOption(styles, trace_tp2)], request)
    result.degrees      # per degree: its fastest plan's speed and peak, or why none fits

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
  FSDP already hides its communication. :func:`degree_reason` gives the figures, for the summary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from shard_planner.errors import InfeasibleError, UserError, first_line
from shard_planner.plan import FrontierPoint
from shard_planner.solve.planner import plan_model
from shard_planner.solve.request import PlanRequest, PlanResult
from shard_planner.tensor_parallel import TensorParallel
from shard_planner.trace.types import ModelTrace
from shard_planner.units import format_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DegreeOption:
    """One tensor-parallel degree to search: its styles (None at degree 1) and the trace of one rank."""

    tensor_parallel: TensorParallel | None
    trace: ModelTrace

    @property
    def degree(self) -> int:
        return self.trace.tp_size


@dataclass(frozen=True)
class DegreeOutcome:
    """What one degree's search found: its fastest plan's step time, samples per second, peak, compute and
    exposed communication (tensor-parallel collectives included, and apart), or ``refused``: why none fits."""

    degree: int
    step_time_s: float | None = None
    samples_per_s: float | None = None
    peak_bytes: int | None = None
    compute_s: float | None = None
    exposed_comm_s: float | None = None
    tp_comm_s: float | None = None
    refused: str | None = None

    @property
    def label(self) -> str:
        return degree_label(self.degree)


def degree_label(degree: int) -> str:
    return "no tensor parallelism" if degree == 1 else f"TP {degree}"


def plan_over_degrees(options: list[DegreeOption], request: PlanRequest) -> tuple[PlanResult, tuple[DegreeOutcome, ...]]:
    """The fastest plan over ``options``' degrees, with each degree's outcome; the degrees' own fastest plans
    join the answer's baselines (so the report shows them beside its frontier). One degree that cannot be
    planned (no plan fits; a global batch its data-parallel ranks do not divide) is an outcome; all of them
    raise the first one's error."""
    if not options:
        raise UserError("no tensor-parallel degree to plan (--tp must divide the GPUs per node and the model)")
    results: list[tuple[DegreeOption, PlanResult]] = []
    outcomes: list[DegreeOutcome] = []
    errors: list[UserError] = []
    for opt in options:
        try:
            r = plan_model(opt.trace, replace(request, tensor_parallel=opt.tensor_parallel))
        except (InfeasibleError, UserError) as e:
            if len(options) == 1:
                raise
            errors.append(e)
            outcomes.append(DegreeOutcome(opt.degree, refused=first_line(e)))
            logger.info("TP %d: %s", opt.degree, first_line(e))
            continue
        results.append((opt, r))
        t = r.estimate.time
        outcomes.append(DegreeOutcome(opt.degree, t.step_time_s, t.samples_per_s, r.estimate.memory.peak_bytes,
                                      t.compute_s, t.exposed_comm_s, t.tp_comm_s))
    if not results:
        raise errors[0]
    _, best = max(results, key=lambda pair: pair[1].estimate.time.samples_per_s)
    others = tuple(FrontierPoint(r.plan.predicted.peak_bytes, r.plan.predicted.step_time_s,
                                 f"fastest at {degree_label(o.degree)}")
                   for o, r in results if r is not best)
    plan = replace(best.plan, baselines=best.plan.baselines + others)
    return replace(best, plan=plan), tuple(sorted(outcomes, key=lambda o: o.degree))


def degree_reason(chosen: DegreeOutcome, outcomes: tuple[DegreeOutcome, ...]) -> str:
    """One line for the summary: how much less throughput each other degree's fastest plan has (samples per
    second: at a fixed micro-batch a degree's step holds gpus / tp micro-batches), and where its step goes
    beside the chosen one's (compute, exposed communication and of it the tensor-parallel collectives, peak):
    the figures behind [Note: Why a degree wins or loses], or why a degree has no plan."""

    def split(o: DegreeOutcome) -> str:
        return (f"step {o.step_time_s * 1e3:.4g} ms: compute {o.compute_s * 1e3:.4g} ms, exposed communication "
                f"{o.exposed_comm_s * 1e3:.4g} ms (TP {o.tp_comm_s * 1e3:.4g} ms), peak {format_bytes(o.peak_bytes)}")

    parts = []
    for o in outcomes:
        if o.degree == chosen.degree:
            continue
        if o.refused is not None:
            parts.append(f"{o.label}: {o.refused}")
            continue
        change = o.samples_per_s / chosen.samples_per_s - 1 if chosen.samples_per_s else 0.0
        parts.append(f"{o.label} {100 * change:+.1f}% samples/s ({split(o)})")
    return f"{chosen.label} chosen ({split(chosen)})" + ("; " + "; ".join(parts) if parts else "")
