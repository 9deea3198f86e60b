"""The plans a search judged beside the chosen one, as the plan file keeps them for the summary and the
report: the frontier's and the recipes' points (:class:`FrontierPoint`), the plans ``tune``
ran (:class:`MeasuredPoint`), and each split of the model over ranks the planner searched
(:class:`LayoutOutcome`, solve/layout_search.py)."""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.parallel.mesh import ModelSplit
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


# How a layout's figures were found: by the full search (plan_model), by the layout screen alone (its
# fastest heuristic plan: solve/layout_search.py [Note: Screening the layouts]), or not at all (``refused``).
LAYOUT_JUDGED = ("solved", "screened", "refused")


@dataclass(frozen=True)
class LayoutOutcome:
    """One split of the model over ranks the planner searched (``split``: its tensor-parallel degree, later
    its pipeline stages; parallel/mesh.py ``ModelSplit``), with the data-parallel layout its search chose:
    its fastest plan's step time, samples per second (the whole cluster), peak, compute and exposed
    communication (the split's own collectives included, and apart: ``split_comm_s``), the samples one step
    holds (micro-batch x accumulation x data-parallel ranks: what turns its frontier's step times into
    throughput), its Pareto frontier (solved layouts), its fastest plan for people (``fastest_plan``: mesh,
    micro-batch and accumulation, checkpointed units), or why no plan of it fits (``refused``)."""

    split: ModelSplit
    judged: str = "solved"  # one of LAYOUT_JUDGED
    step_time_s: float | None = None
    samples_per_s: float | None = None
    peak_bytes: int | None = None
    compute_s: float | None = None
    exposed_comm_s: float | None = None
    split_comm_s: float | None = None
    samples_per_step: int | None = None
    frontier: tuple[FrontierPoint, ...] = ()
    refused: str | None = None
    fastest_plan: str = ""

    def __post_init__(self):
        object.__setattr__(self, "frontier", tuple(self.frontier))

    @property
    def label(self) -> str:
        return self.split.label


def layout_lines(chosen_split: ModelSplit, outcomes: tuple[LayoutOutcome, ...]) -> list[str]:
    """For the summary, a line per layout, the chosen one first: its fastest plan and where its step goes
    (compute, exposed communication and of it the split's collectives, peak), and for the others how much
    less throughput they have (samples per second: at a fixed micro-batch a layout's step holds one
    micro-batch per data-parallel rank): the figures behind solve/layout_search.py [Note: Why a layout wins
    or loses]; whether a layout was only screened, or why it has no plan."""

    def figures(o: LayoutOutcome) -> str:
        plan = f"{o.fastest_plan}; " if o.fastest_plan else ""
        return (f"{plan}step {format_duration(o.step_time_s)}: compute {format_duration(o.compute_s)}, exposed "
                f"communication {format_duration(o.exposed_comm_s)} ({o.split.comm_label} "
                f"{format_duration(o.split_comm_s)}), peak {format_bytes(o.peak_bytes)}")

    chosen = next(o for o in outcomes if o.split == chosen_split)
    lines = [f"{chosen.label} chosen ({figures(chosen)})"]
    for o in outcomes:
        if o is chosen:
            continue
        if o.refused is not None:
            lines.append(f"{o.label}: {o.refused}")
            continue
        change = o.samples_per_s / chosen.samples_per_s - 1 if chosen.samples_per_s else 0.0
        how = "; screened only: its fastest heuristic plan, too far behind to search" if o.judged == "screened" else ""
        lines.append(f"{o.label}: {100 * change:+.1f}% samples/s ({figures(o)}{how})")
    return lines


def layout_reason(chosen_split: ModelSplit, outcomes: tuple[LayoutOutcome, ...]) -> str:
    """:func:`layout_lines` as one line."""
    return "; ".join(layout_lines(chosen_split, outcomes))


def layouts_from_degrees(d: dict) -> dict:
    """``d`` with a plan file's ``tp_degrees`` (written before the layout search keyed its outcomes by the
    split, ``layouts``) read as ``layouts``: each degree's ``degree`` its split's ``tp``, its ``tp_comm_s``
    the split's collectives, its ``layout`` its fastest plan; anything else in an entry is checked as
    ``layouts`` is, where its JSON path names it."""
    if "tp_degrees" not in d or "layouts" in d or not isinstance(d["tp_degrees"], list):
        return d
    renamed = {"degree": "split", "tp_comm_s": "split_comm_s", "layout": "fastest_plan"}
    layouts = [{renamed.get(k, k): ({"tp": v} if k == "degree" else v) for k, v in o.items()}
               if isinstance(o, dict) else o for o in d["tp_degrees"]]
    return {**{k: v for k, v in d.items() if k != "tp_degrees"}, "layouts": layouts}
