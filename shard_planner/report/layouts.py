"""The layouts in the report: every split of the model over ranks ``plan`` searched (``Plan.layouts``,
solve/layout_search.py: the tensor-parallel degrees), drawn and tabled beside the chosen one.

A layout's plans do the work of its own global batch per step: at a fixed micro-batch its step holds one
micro-batch per data-parallel rank (x accumulation), and the search may pick each layout's micro-batch apart.
So each layout's step times become throughput with that layout's work per step
(``LayoutOutcome.samples_per_step``, x the sequence length when the model has one: tokens), not the chosen
plan's (:func:`layout_throughput`); the figure is read as samples or tokens per second over the whole
cluster, the figure the planner compares the layouts by. Solved layouts are drawn as their Pareto frontier,
a layout only screened as its fastest heuristic plan (a hollow diamond: what a full search would at least
find), a refused layout only in the table. Artists carry gids, each with the split's key (``ModelSplit.key``,
``tp2``): "frontier:<key>" (and "frontier-fits:<key>", "frontier-over:<key>") per solved layout,
"screened:<key>", "chosen", "budget", "usable-budget".
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from shard_planner.plan import Plan
from shard_planner.parallel.mesh import ModelSplit
from shard_planner.plan.points import FrontierPoint, LayoutOutcome
from shard_planner.report.budget import ReportBudget
from shard_planner.report.plots import (
    BASELINE_COLORS, GIB, Throughput, _model_name, _wrap, draw_chosen, draw_frontier_line, finish_throughput_axes,
)

# One colour per split, the same in every report (tab10, as the other plots); another split takes the
# recipes' palette in its order among the plan's layouts.
SPLIT_COLORS = {ModelSplit(tp=1): "#1f77b4", ModelSplit(tp=2): "#ff7f0e", ModelSplit(tp=4): "#2ca02c",
                ModelSplit(tp=8): "#9467bd"}


def layout_throughput(plan: Plan, outcome: LayoutOutcome) -> Throughput:
    """How ``outcome``'s step times become throughput: its own global batch per step (x the sequence length
    when the model has one), whole cluster (see the module docstring)."""
    return Throughput(outcome.samples_per_step * (plan.model.seq_len or 1), throughput_unit(plan))


def throughput_unit(plan: Plan) -> str:
    return "tokens/s" if plan.model.seq_len else "samples/s"


def _color(plan: Plan, split: ModelSplit) -> str:
    index = [o.split for o in plan.layouts].index(split)
    return SPLIT_COLORS.get(split, BASELINE_COLORS[index % len(BASELINE_COLORS)])


def _chosen(plan: Plan) -> LayoutOutcome:
    return next(o for o in plan.layouts if o.split == plan.mesh.split)


def plot_layouts(plan: Plan, budget: ReportBudget) -> Figure | None:
    """Peak memory per GPU (x) vs throughput (y) of every layout the plan searched: one Pareto frontier per
    solved layout (its fastest plan where it kept no frontier), one hollow diamond per layout screened only,
    the chosen plan (star) and the budget lines, as :func:`~shard_planner.report.plots.plot_frontier` draws
    them. None for a plan of one layout."""
    if not plan.layouts:
        return None
    fig = Figure(figsize=(10, 5.6), layout="constrained")
    ax = fig.add_subplot()
    peaks_bytes: list[int] = []
    over_label = "frontier plan over the usable budget" if budget.has_usable else "frontier plan over the budget"
    for o in plan.layouts:
        if o.judged == "refused":
            continue
        tp = layout_throughput(plan, o)
        color = _color(plan, o.split)
        chosen = " (chosen)" if o.split == plan.mesh.split else ""
        if o.judged == "screened":
            ax.scatter([o.peak_bytes / GIB], [tp.of(o.step_time_s)], s=80, marker="D", facecolors="white",
                       edgecolors=color, linewidths=1.6, zorder=4, gid=f"screened:{o.split.key}",
                       label=_wrap(f"{o.label}: screened only (its fastest heuristic plan)"))
            peaks_bytes.append(o.peak_bytes)
            continue
        points = o.frontier or (FrontierPoint(o.peak_bytes, o.step_time_s, f"{o.label}: its fastest plan"),)
        draw_frontier_line(ax, points, tp, budget, color=color, label=f"{o.label}{chosen}: frontier",
                           over_label=over_label, gid_suffix=f":{o.split.key}")
        if any(not (q.fits and budget.fits(q.peak_bytes)) for q in points):
            over_label = None  # one legend entry for the hollow points of every layout
        peaks_bytes += [q.peak_bytes for q in points]
    tp = layout_throughput(plan, _chosen(plan))
    draw_chosen(ax, plan, tp, budget)
    if plan.predicted is not None:
        peaks_bytes.append(plan.predicted.peak_bytes)
    finish_throughput_axes(fig, ax, budget, tp.unit, peaks_bytes,
                           f"Memory vs throughput per layout (tensor-parallel degree): {_model_name(plan)} on "
                           f"{budget.ranks(plan.cluster.gpus)}")
    return fig


def layouts_table(plan: Plan) -> pd.DataFrame:
    """One row per layout the plan searched, in split order: how it was judged, its fastest plan's step
    time, throughput (its own work per step: :func:`layout_throughput`), peak, and where its step goes
    (compute, exposed communication and, of it, the split's own collectives), or why it has no plan; the
    chosen layout marked."""
    unit = throughput_unit(plan)
    nan = float("nan")  # no figure: a refused layout's row (rendered empty)
    comm = _chosen(plan).split.comm_label  # one column for every layout's own collectives

    def row(o: LayoutOutcome) -> dict:
        found = o.judged != "refused"
        return {
            "layout": o.label + (" (chosen)" if o.split == plan.mesh.split else ""),
            "judged": o.judged,
            "global batch (samples)": o.samples_per_step if found else nan,
            "step time (s)": o.step_time_s if found else nan,
            f"throughput ({unit})": layout_throughput(plan, o).of(o.step_time_s) if found else nan,
            "peak (GiB)": o.peak_bytes / GIB if found else nan,
            "compute (s)": o.compute_s if found else nan,
            "exposed comm. (s)": o.exposed_comm_s if found else nan,
            f"of it {comm} collectives (s)": o.split_comm_s if found else nan,
            "why refused": o.refused or "",
        }

    records = [row(o) for o in plan.layouts]
    df = pd.DataFrame.from_records(records)
    # whole samples (512, not 512.0): beside a refused row's NaN pandas would make the column float
    df["global batch (samples)"] = pd.Series([r["global batch (samples)"] for r in records], dtype=object)
    return df
