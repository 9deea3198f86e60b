"""The plans a search judged beside the chosen one, as the plan file keeps them for the summary and the
report: the frontier's and the recipes' points (:class:`FrontierPoint`), the plans ``tune``
ran (:class:`MeasuredPoint`), and each tensor-parallel degree the planner searched (:class:`DegreeOutcome`,
solve/tp_search.py)."""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.units import format_bytes, format_duration


@dataclass(frozen=True)
class FrontierPoint:
    peak_bytes: int
    step_time_s: float
    description: str
    fits: bool = True  # within the budget (baselines may not fit)


@dataclass(frozen=True)
class MeasuredPoint:
    """One plan run for real by ``shard-planner tune``: a summary of its Measurement."""

    description: str
    plan_fingerprint: str  # shard_planner.plan.measurement.plan_fingerprint of the plan that ran
    world_size: int  # where it ran (the plan may have been re-derived for it)
    peak_bytes: int  # measured, the largest over ranks
    step_time_s: float  # measured, median of the timed steps
    predicted_peak_bytes: int | None = None  # the cost model's, for the run's world size
    predicted_step_time_s: float | None = None  # the cost model's with the fitted profile
    chosen: bool = False  # the measured best, returned as the plan


# How a degree's figures were found: by the full search (plan_model), by the degree screen alone (its
# fastest heuristic plan: solve/tp_search.py [Note: Screening the degrees]), or not at all (``refused``).
DEGREE_JUDGED = ("solved", "screened", "refused")


@dataclass(frozen=True)
class DegreeOutcome:
    """One tensor-parallel degree the planner searched: its fastest plan's step time, samples per second
    (the whole cluster), peak, compute and exposed communication (tensor-parallel collectives included,
    and apart), the samples one step holds (micro-batch x accumulation x gpus / degree: what turns its
    frontier's step times into throughput), its Pareto frontier (solved degrees), or why no plan of it
    fits (``refused``)."""

    degree: int
    judged: str = "solved"  # one of DEGREE_JUDGED
    step_time_s: float | None = None
    samples_per_s: float | None = None
    peak_bytes: int | None = None
    compute_s: float | None = None
    exposed_comm_s: float | None = None
    tp_comm_s: float | None = None
    samples_per_step: int | None = None
    frontier: tuple[FrontierPoint, ...] = ()
    refused: str | None = None
    layout: str = ""  # its fastest plan for people: mesh, micro-batch and accumulation, checkpointed units

    def __post_init__(self):
        object.__setattr__(self, "frontier", tuple(self.frontier))

    @property
    def label(self) -> str:
        return degree_label(self.degree)


def degree_label(degree: int) -> str:
    return "no tensor parallelism" if degree == 1 else f"TP {degree}"


def degree_lines(plan_degree: int, outcomes: tuple[DegreeOutcome, ...]) -> list[str]:
    """For the summary, a line per degree, the chosen one first: its fastest plan's layout and where its step
    goes (compute, exposed communication and of it the tensor-parallel collectives, peak), and for the
    others how much less throughput they have (samples per second: at a fixed micro-batch a degree's step
    holds gpus / tp micro-batches): the figures behind solve/tp_search.py [Note: Why a degree wins or
    loses]; whether a degree was only screened, or why it has no plan."""

    def split(o: DegreeOutcome) -> str:
        layout = f"{o.layout}; " if o.layout else ""
        return (f"{layout}step {format_duration(o.step_time_s)}: compute {format_duration(o.compute_s)}, exposed "
                f"communication {format_duration(o.exposed_comm_s)} (TP {format_duration(o.tp_comm_s)}), peak "
                f"{format_bytes(o.peak_bytes)}")

    chosen = next(o for o in outcomes if o.degree == plan_degree)
    lines = [f"{chosen.label} chosen ({split(chosen)})"]
    for o in outcomes:
        if o is chosen:
            continue
        if o.refused is not None:
            lines.append(f"{o.label}: {o.refused}")
            continue
        change = o.samples_per_s / chosen.samples_per_s - 1 if chosen.samples_per_s else 0.0
        how = "; screened only: its fastest heuristic plan, too far behind to search" if o.judged == "screened" else ""
        lines.append(f"{o.label}: {100 * change:+.1f}% samples/s ({split(o)}{how})")
    return lines


def degree_reason(plan_degree: int, outcomes: tuple[DegreeOutcome, ...]) -> str:
    """:func:`degree_lines` as one line."""
    return "; ".join(degree_lines(plan_degree, outcomes))
