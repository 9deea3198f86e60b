"""The tensor-parallel degrees in the report: every degree ``plan`` searched (``Plan.tp_degrees``,
solve/tp_search.py), drawn and tabled beside the chosen one.

A degree's plans do the work of its own global batch per step: at a fixed micro-batch its step holds
``gpus / tp`` micro-batches (x accumulation), and the search may pick each degree's micro-batch apart. So
each degree's step times become throughput with that degree's work per step
(``DegreeOutcome.samples_per_step``, x the sequence length when the model has one: tokens), not the chosen
plan's (:func:`degree_throughput`); the figure is read as samples or tokens per second over the whole
cluster, the figure the planner compares the degrees by. Solved degrees are drawn as their Pareto frontier,
a degree only screened as its fastest heuristic plan (a hollow diamond: what a full search would at least
find), a refused degree only in the table. Artists carry gids: "frontier:tp<d>" (and "frontier-fits:tp<d>",
"frontier-over:tp<d>") per solved degree, "screened:tp<d>", "chosen", "budget", "usable-budget".
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from shard_planner.plan import Plan
from shard_planner.plan.points import DegreeOutcome, FrontierPoint
from shard_planner.report.budget import ReportBudget
from shard_planner.report.plots import (
    BASELINE_COLORS, GIB, Throughput, _model_name, _wrap, draw_chosen, draw_frontier_line, finish_throughput_axes,
)

# One colour per degree, the same in every report (tab10, as the other plots).
DEGREE_COLORS = {1: "#1f77b4", 2: "#ff7f0e", 4: "#2ca02c", 8: "#9467bd"}


def degree_throughput(plan: Plan, outcome: DegreeOutcome) -> Throughput:
    """How ``outcome``'s step times become throughput: its own global batch per step (x the sequence length
    when the model has one), whole cluster (see the module docstring)."""
    return Throughput(outcome.samples_per_step * (plan.model.seq_len or 1), throughput_unit(plan))


def throughput_unit(plan: Plan) -> str:
    return "tokens/s" if plan.model.seq_len else "samples/s"


def _color(degree: int) -> str:
    return DEGREE_COLORS.get(degree, BASELINE_COLORS[degree % len(BASELINE_COLORS)])


def _chosen(plan: Plan) -> DegreeOutcome:
    return next(o for o in plan.tp_degrees if o.degree == plan.mesh.tp)


def plot_degrees(plan: Plan, budget: ReportBudget) -> Figure | None:
    """Peak memory per GPU (x) vs throughput (y) of every degree the plan searched: one Pareto frontier per
    solved degree (its fastest plan where it kept no frontier), one hollow diamond per degree screened only,
    the chosen plan (star) and the budget lines, as :func:`~shard_planner.report.plots.plot_frontier` draws
    them. None for a plan of one degree."""
    if not plan.tp_degrees:
        return None
    fig = Figure(figsize=(10, 5.6), layout="constrained")
    ax = fig.add_subplot()
    peaks_bytes: list[int] = []
    over_label = "frontier plan over the usable budget" if budget.has_usable else "frontier plan over the budget"
    for o in plan.tp_degrees:
        if o.judged == "refused":
            continue
        tp = degree_throughput(plan, o)
        chosen = " (chosen)" if o.degree == plan.mesh.tp else ""
        if o.judged == "screened":
            ax.scatter([o.peak_bytes / GIB], [tp.of(o.step_time_s)], s=80, marker="D", facecolors="white",
                       edgecolors=_color(o.degree), linewidths=1.6, zorder=4, gid=f"screened:tp{o.degree}",
                       label=_wrap(f"{o.label}: screened only (its fastest heuristic plan)"))
            peaks_bytes.append(o.peak_bytes)
            continue
        points = o.frontier or (FrontierPoint(o.peak_bytes, o.step_time_s, f"{o.label}: its fastest plan"),)
        draw_frontier_line(ax, points, tp, budget, color=_color(o.degree), label=f"{o.label}{chosen}: frontier",
                           over_label=over_label, gid_suffix=f":tp{o.degree}")
        if any(not (q.fits and budget.fits(q.peak_bytes)) for q in points):
            over_label = None  # one legend entry for the hollow points of every degree
        peaks_bytes += [q.peak_bytes for q in points]
    tp = degree_throughput(plan, _chosen(plan))
    draw_chosen(ax, plan, tp, budget)
    if plan.predicted is not None:
        peaks_bytes.append(plan.predicted.peak_bytes)
    finish_throughput_axes(fig, ax, budget, tp.unit, peaks_bytes,
                           f"Memory vs throughput per tensor-parallel degree: {_model_name(plan)} on "
                           f"{budget.ranks(plan.cluster.gpus)}")
    return fig


def degrees_table(plan: Plan) -> pd.DataFrame:
    """One row per degree the plan searched, in degree order: how it was judged, its fastest plan's step
    time, throughput (its own work per step: :func:`degree_throughput`), peak, and where its step goes
    (compute, exposed communication and, of it, the tensor-parallel collectives), or why it has no plan;
    the chosen degree marked."""
    unit = throughput_unit(plan)
    nan = float("nan")  # no figure: a refused degree's row (rendered empty)

    def row(o: DegreeOutcome) -> dict:
        found = o.judged != "refused"
        return {
            "degree": o.label + (" (chosen)" if o.degree == plan.mesh.tp else ""),
            "judged": o.judged,
            "global batch (samples)": o.samples_per_step if found else nan,
            "step time (s)": o.step_time_s if found else nan,
            f"throughput ({unit})": degree_throughput(plan, o).of(o.step_time_s) if found else nan,
            "peak (GiB)": o.peak_bytes / GIB if found else nan,
            "compute (s)": o.compute_s if found else nan,
            "exposed comm. (s)": o.exposed_comm_s if found else nan,
            "of it TP collectives (s)": o.tp_comm_s if found else nan,
            "why refused": o.refused or "",
        }

    records = [row(o) for o in plan.tp_degrees]
    df = pd.DataFrame.from_records(records)
    # whole samples (512, not 512.0): beside a refused row's NaN pandas would make the column float
    df["global batch (samples)"] = pd.Series([r["global batch (samples)"] for r in records], dtype=object)
    return df
