"""The report's pictures, one function per plot, each returning a matplotlib ``Figure``.

Figures are built with ``matplotlib.figure.Figure`` (no pyplot: no global state, no GUI backend; PNGs are
rendered by Agg), so tests can inspect the artists before anything is saved. Each plot puts its units in
the axis labels (GiB, MiB, s, ms, tokens/s) and keeps legends outside the data so no text overlaps.
Artists the tests look for carry a ``gid`` ("frontier", "chosen", "budget", "usable-budget", "budget-off-scale",
"baseline:<name>"; per layout "frontier:tp<d>" and "screened:tp<d>", report/layouts.py; the
memory timeline's: report/timeline.py). Every memory plot draws the same two budget lines (:func:`draw_budget`):
--mem, dashed, and the usable budget the planner fills (--mem less the fragmentation share), dotted; or, zoomed
to data far under them, names them in the legend ([Note: Zoom to the data]).
"""

from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # the report never opens a window; harmless if a caller already chose Agg

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator  # noqa: E402

from shard_planner.plan import MEMORY_CATEGORIES, FrontierPoint, Plan, Prediction  # noqa: E402
from shard_planner.report.budget import ReportBudget  # noqa: E402
from shard_planner.report.engine_words import FSDP2_WORDS, EngineWords  # noqa: E402
from shard_planner.report.rows import UnitRow, exposed_columns  # noqa: E402
from shard_planner.units import format_bytes  # noqa: E402

GIB = 2**30
# One colour per memory category, the same in every plot (matplotlib's tab10, colour-blind friendlier
# than the default cycle when stacked).
CATEGORY_COLORS = dict(zip(MEMORY_CATEGORIES, (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#d62728", "#8c564b", "#e377c2", "#7f7f7f")))
CATEGORY_LABELS = {
    "sharded_params": "sharded params",
    "unsharded_params": "unsharded params (all-gathered)",
    "grads": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "temporaries": "temporaries",
    "comm_buffers": "communication buffers",
    "overhead": "overhead (CUDA context, NCCL)",
}


def category_labels(words: EngineWords) -> dict[str, str]:
    """Each memory category's name in the legends, as the plan's engine holds it (``words``: on one device the
    parameters are not sharded)."""
    return {**CATEGORY_LABELS, "sharded_params": words.params}


EXPOSED_COLORS = ("#d62728", "#e377c2", "#ff9896", "#9467bd")  # the parts of exposed communication, in order
BASELINE_MARKERS = ("s", "D", "^", "v", "P", "p", "h", "<", ">")
BASELINE_COLORS = ("#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def figure_png(fig: Figure, dpi: int = 110) -> bytes:
    """The figure as PNG bytes (Agg)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def figures_png(figures: dict[str, Figure]) -> dict[str, bytes]:
    """Each figure as PNG bytes, by name (what :func:`shard_planner.report.write_report` renders unless
    it is given another renderer)."""
    return {name: figure_png(fig) for name, fig in figures.items()}


def byte_scale(max_bytes: float) -> tuple[float, str]:
    """A divisor and its unit name so the largest value reads between 1 and 1024."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= size:
            return size, unit
    return 1, "bytes"


def _thousands(value, _pos) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def draw_budget(ax, budget: ReportBudget, scale: float, *, vertical: bool, zorder: float = 4,
                on_scale: bool = True) -> None:
    """The budget lines on ``ax`` (values divided by ``scale``), labelled for the legend: --mem dashed
    (gid "budget") and, when the profile gives one below it, the usable budget dotted (gid "usable-budget");
    when the axis is zoomed to the data (``on_scale`` False: [Note: Zoom to the data]), no line but a legend
    entry that names both and points where they are (gid "budget-off-scale")."""
    if not on_scale:
        usable = f", usable {format_bytes(budget.usable_bytes)}" if budget.has_usable else ""
        ax.plot([], [], ls="none", color="#d62728", marker=r"$\rightarrow$" if vertical else r"$\uparrow$", ms=10,
                gid="budget-off-scale",
                label=_wrap(f"budget off scale ({'right' if vertical else 'above'}): {budget.mem_label}{usable}"))
        return
    line = ax.axvline if vertical else ax.axhline
    line(budget.mem_bytes / scale, color="#d62728", ls="--", lw=1.3, zorder=zorder, gid="budget",
         label=_wrap(f"budget: {budget.mem_label}"))
    if budget.has_usable:
        line(budget.usable_bytes / scale, color="#d62728", ls=":", lw=1.6, zorder=zorder, gid="usable-budget",
             label=_wrap(budget.usable_label))


def _budget_top(budget: ReportBudget) -> int:
    return max(budget.mem_bytes, budget.usable_bytes)


# [Note: Zoom to the data]
#   A memory axis runs from 0 past the budget lines while the data reaches ZOOM_FRACTION of the budget. A
#   tiny model under a large --mem (1 GiB of a 40 GiB budget) would put every point on the zero line, so
#   below that the axis ends just above the data and the budget is named in the legend, with an arrow to
#   where it is (draw_budget's "budget-off-scale"). One rule for every memory axis of the report.
ZOOM_FRACTION = 0.5


def budget_on_scale(data_top_bytes: float, budget: ReportBudget) -> bool:
    """The budget lines belong on a memory axis whose data reach ``data_top_bytes`` ([Note: Zoom to the data])."""
    return data_top_bytes >= ZOOM_FRACTION * _budget_top(budget)


# ---- memory vs throughput ----

@dataclass(frozen=True)
class Throughput:
    """How a step time becomes a throughput for one plan file: the work one step does, whole cluster."""

    work_per_step: float
    unit: str  # "tokens/s" or "samples/s"

    def of(self, step_time_s: float) -> float:
        return self.work_per_step / step_time_s


def plan_throughput(plan: Plan) -> Throughput:
    """Work per step from the prediction when there is one (tokens if the model has tokens), else from
    the plan: micro-batch x data-parallel ranks (x sequence length). Every point of a frontier is a plan
    of the same model at the same micro-batch, so the same work per step applies to all of them."""
    p = plan.predicted
    if p is not None and p.step_time_s > 0:
        if p.tokens_per_s:
            return Throughput(p.tokens_per_s * p.step_time_s, "tokens/s")
        return Throughput(p.samples_per_s * p.step_time_s, "samples/s")
    samples = plan.global_batch_samples  # micro-batch x accumulation steps x data-parallel ranks
    if plan.model.seq_len:
        return Throughput(samples * plan.model.seq_len, "tokens/s")
    return Throughput(samples, "samples/s")


def plot_frontier(plan: Plan, budget: ReportBudget) -> Figure | None:
    """Peak memory per GPU (x) vs throughput (y): the Pareto frontier joined in memory order, the
    budget lines (--mem and the usable budget), the chosen plan (star), each recipe
    labelled in the legend; points over the usable budget are drawn hollow (frontier) or as an X
    (policies). None when the plan holds no point to compare the chosen plan with (no frontier, no
    policies)."""
    if not plan.frontier and not plan.baselines:
        return None
    tp = plan_throughput(plan)
    fig = Figure(figsize=(10, 5.6), layout="constrained")
    ax = fig.add_subplot()
    draw_frontier_line(ax, plan.frontier, tp, budget, color="#1f77b4", label="Pareto frontier",
                       over_label="frontier plan over the usable budget" if budget.has_usable
                       else "frontier plan over the budget")

    for i, b in enumerate(plan.baselines):
        color = BASELINE_COLORS[i % len(BASELINE_COLORS)]
        fits = b.fits and budget.fits(b.peak_bytes)
        marker = BASELINE_MARKERS[i % len(BASELINE_MARKERS)] if fits else "X"
        ax.scatter([b.peak_bytes / GIB], [tp.of(b.step_time_s)], s=70 if fits else 90, marker=marker,
                   color=color, edgecolors="black", linewidths=0.6, zorder=4, gid=f"baseline:{b.description}",
                   label=_wrap(b.description + ("" if fits else " (does not fit)")))

    draw_chosen(ax, plan, tp, budget)
    mesh = f"\n{plan.mesh.description}" if plan.mesh.is_tp else ""  # without TP the GPU count says it
    finish_throughput_axes(fig, ax, budget, tp.unit, [q.peak_bytes for q in (*plan.frontier, *plan.baselines)]
                           + ([plan.predicted.peak_bytes] if plan.predicted is not None else []),
                           f"Memory vs throughput: {_model_name(plan)} on {budget.ranks(plan.cluster.gpus)}, "
                           f"micro-batch {plan.training.micro_batch}{mesh}")
    return fig


def draw_frontier_line(ax, points: Sequence[FrontierPoint], tp: Throughput, budget: ReportBudget, *, color: str,
                       label: str, over_label: str | None, gid_suffix: str = "") -> None:
    """A Pareto frontier on ``ax``: its points joined in memory order (gid "frontier" + ``gid_suffix``), those
    within the usable budget filled ("frontier-fits"...), those over it hollow ("frontier-over"..., labelled
    ``over_label`` in the legend). Nothing for no points."""
    if not points:
        return
    pts = sorted(points, key=lambda q: (q.peak_bytes, q.step_time_s))
    xs = [q.peak_bytes / GIB for q in pts]
    ys = [tp.of(q.step_time_s) for q in pts]
    ax.plot(xs, ys, "-", color=color, lw=1.5, zorder=2, gid=f"frontier{gid_suffix}",
            label=f"{label} ({len(pts)} plan{'s' if len(pts) > 1 else ''})")
    fits = [q.fits and budget.fits(q.peak_bytes) for q in pts]
    ax.scatter([x for x, f in zip(xs, fits) if f], [y for y, f in zip(ys, fits) if f],
               s=36, color=color, zorder=3, gid=f"frontier-fits{gid_suffix}")
    over = [(x, y) for x, y, f in zip(xs, ys, fits) if not f]
    if over:
        ax.scatter(*zip(*over), s=36, facecolors="white", edgecolors=color, zorder=3,
                   gid=f"frontier-over{gid_suffix}", label=over_label)


def draw_chosen(ax, plan: Plan, tp: Throughput, budget: ReportBudget) -> None:
    """The chosen plan as a gold star (gid "chosen"), its peak and throughput in the legend, drawn under the
    recipes' markers; nothing when the plan has no prediction."""
    p = plan.predicted
    if p is None:
        return
    over = "" if budget.fits(p.peak_bytes) else " (does not fit)"
    ax.scatter([p.peak_bytes / GIB], [tp.of(p.step_time_s)], s=260, marker="*", color="gold",
               edgecolors="black", linewidths=0.8, zorder=3.5, gid="chosen",  # under the (smaller) policy
               # markers, so a recipe the planner chose shows inside the star
               label=_wrap(f"chosen plan: {format_bytes(p.peak_bytes)}, {tp.of(p.step_time_s):,.0f} {tp.unit}{over}"))


def finish_throughput_axes(fig: Figure, ax, budget: ReportBudget, unit: str, peaks_bytes: Sequence[int],
                           title: str) -> None:
    """What every memory vs throughput plot shares: the budget lines, the axis labels (GiB, ``unit``), the
    x range from 0 past the budget and every point's peak (``peaks_bytes``, the chosen plan's too), the
    grid, the title and the legend outside the data."""
    on_scale = budget_on_scale(max(peaks_bytes, default=0), budget)
    draw_budget(ax, budget, GIB, vertical=True, zorder=1, on_scale=on_scale)
    ax.set_xlabel(f"predicted peak memory per {budget.rank_word} (GiB)")
    ax.set_ylabel(f"predicted throughput, whole cluster ({unit})")
    ax.yaxis.set_major_formatter(FuncFormatter(_thousands))
    if on_scale:
        ax.set_xlim(left=0, right=max([_budget_top(budget), *peaks_bytes]) / GIB * 1.08)
    else:  # the points' range, padded: they may differ by a few MiB ([Note: Zoom to the data])
        lo, hi = min(peaks_bytes) / GIB, max(peaks_bytes) / GIB
        pad = max((hi - lo) * 0.15, hi * 0.002)
        ax.set_xlim(left=max(0.0, lo - pad), right=hi + pad)
        scale, name = byte_scale(max(peaks_bytes))
        if scale < GIB:  # the points stay in GiB (the figure's data); the ticks read in the unit that fits, at
            # round values of it (ticks placed in GiB read 4.096, 4.608, ... MiB)
            ax.set_xlabel(f"predicted peak memory per {budget.rank_word} ({name})")
            shown = MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10]).tick_values(*(v * GIB / scale for v in ax.get_xlim()))
            ax.xaxis.set_major_locator(FixedLocator([v * scale / GIB for v in shown]))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v * GIB / scale:.4g}"))
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    fig.legend(loc="outside right upper", fontsize=8, frameon=False)


def _wrap(label: str, width: int = 44) -> str:
    """A legend label on several lines, so a long policy name does not squeeze the plot."""
    return "\n".join(textwrap.wrap(label, width)) or label


def _model_name(plan: Plan) -> str:
    return plan.model.path.rsplit("/", 1)[-1]


# ---- memory at the peak (the timeline: report/timeline.py) ----

def plot_memory_at_peak(prediction: Prediction, budget: ReportBudget, title: str = "", *,
                        labels: dict[str, str] = CATEGORY_LABELS) -> Figure:
    """What the plan file holds without a trace: memory at the peak by category (named by ``labels``: see
    :func:`category_labels`), one stacked bar, and the budget lines (drawn when no timeline can be simulated)."""
    on_scale = budget_on_scale(prediction.peak_bytes, budget)
    top_bytes = max(prediction.peak_bytes, _budget_top(budget)) if on_scale else prediction.peak_bytes
    cats = [c for c in MEMORY_CATEGORIES if prediction.memory_at_peak.get(c, 0)]
    scale, unit = byte_scale(top_bytes)
    fig = Figure(figsize=(9, 2.6), layout="constrained")
    ax = fig.add_subplot()
    left = 0.0
    for c in cats:
        v = prediction.memory_at_peak[c] / scale
        ax.barh([0], [v], left=[left], height=0.5, color=CATEGORY_COLORS[c],
                label=f"{labels[c]}: {v:.2f} {unit}", gid=f"cat:{c}")
        left += v
    draw_budget(ax, budget, scale, vertical=True, on_scale=on_scale)
    ax.set_yticks([0], ["at the peak"])
    ax.set_xlabel(f"predicted memory per {budget.rank_word} ({unit})")
    ax.set_xlim(0, max(left, top_bytes / scale) * 1.08)
    ax.set_title(title or f"Memory at the predicted peak: {prediction.peak_bytes / scale:.2f} {unit}")
    fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    return fig


# ---- per unit ----

def _time_scale(max_s: float) -> tuple[float, str]:
    return (1.0, "s") if max_s >= 1.0 else (1e-3, "ms")


# the units figure's parameter bars (report/engine_words.py ``param_columns``), coloured as their memory category
_PARAM_COLORS = {"sharded_param_bytes": CATEGORY_COLORS["sharded_params"],
                 "unsharded_param_bytes": CATEGORY_COLORS["unsharded_params"]}


def unit_label(row: UnitRow, reshards: bool = True) -> str:
    """The row's name and its decisions' tags (``reshards`` False: an engine that does not reshard,
    report/engine_words.py)."""
    tags = []
    if row.count > 1 and not row.interleaved:  # an interleaved row's label already says "N of M"
        tags.append(f"x{row.count}")
    if row.activation_checkpoint:
        tags.append("SAC" if row.activation_checkpoint == "selective" else "AC")
    if reshards and row.reshard_after_forward is not True:
        tags.append("no reshard" if row.reshard_after_forward is False else f"reshard {row.reshard_after_forward}")
    return row.label + (f"  [{', '.join(tags)}]" if tags else "")


def plot_units(rows: Sequence[UnitRow], title: str = "", rank_word: str = "GPU",
               words: EngineWords = FSDP2_WORDS) -> Figure | None:
    """Horizontal bars per unit (identical consecutive units folded into one row, figures per unit):
    left, the parameter bytes (sharded and unsharded under FSDP2; on one device what it holds: ``words``, the
    plan's engine's) and activations kept for backward; right, compute and, where the engine communicates, FSDP's
    collectives on their stream and exposed communication in its parts, hatched (the units table's columns).
    None without per-unit sizes. ``rank_word``: what one rank is called ("GPU", "CPU rank": ReportBudget.rank_word)."""
    rows = [r for r in rows if r.param_count is not None]
    if not rows:
        return None
    has_time = all(r.compute_s is not None for r in rows)
    n = len(rows)
    fig = Figure(figsize=(12, 1.6 + 0.42 * n), layout="constrained")
    axes = fig.subplots(1, 2 if has_time else 1, sharey=True, squeeze=False)[0]
    ys = list(range(n))
    h = 0.26

    ax = axes[0]
    series = [(attr, label, _PARAM_COLORS[attr]) for attr, _, label in words.param_columns]
    series.append(("activation_bytes", "activations kept for backward", CATEGORY_COLORS["activations"]))
    scale, unit = byte_scale(max(getattr(r, attr) for r in rows for attr, _, _ in series))
    for k, (attr, label, color) in enumerate(series):
        ax.barh([y + (k - (len(series) - 1) / 2) * h for y in ys], [getattr(r, attr) / scale for r in rows], height=h,
                color=color, label=label, gid=f"mem:{attr}")
    ax.set_yticks(ys, [unit_label(r, words.shards) for r in rows], fontsize=8)
    ax.invert_yaxis()  # forward order from the top
    ax.set_xlabel(f"memory per {rank_word}, per {words.unit} ({unit})")
    ax.set_title("Memory")
    ax.grid(True, axis="x", alpha=0.3)

    if has_time:
        _plot_unit_times(axes[1], rows, h, words)
    handles = [h for a in axes for h in a.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    u = words.unit
    fig.suptitle(title or f"Per {words.unit_long}, in forward order (xN: N identical consecutive {u}s; N of M: every "
                 f"other {u} of a run, say; figures per {u})", fontsize=10)
    return fig


def _plot_unit_times(ax, rows: Sequence[UnitRow], h: float, words: EngineWords) -> None:
    """The units figure's time panel: compute, then, where the engine communicates (``words.shards``), FSDP's
    collectives and the exposed communication's parts stacked."""
    n, ys, communicates = len(rows), list(range(len(rows))), words.shards
    tops = [max(r.compute_s, r.comm_s, r.exposed_comm_s) if communicates else r.compute_s for r in rows]
    tscale, tunit = _time_scale(max(tops))
    ax.barh([y - h for y in ys] if communicates else ys, [r.compute_s / tscale for r in rows], height=h,
            color="#17becf", label="compute (fwd + bwd + recompute)", gid="time:compute")
    if communicates:
        ax.barh(ys, [r.comm_s / tscale for r in rows], height=h, color="#bcbd22",
                label="FSDP collectives on their stream (all-gather + reduce-scatter)", gid="time:comm")
        left = [0.0] * n  # exposed communication, its parts stacked (the units table's columns)
        for (field, name), color in zip(exposed_columns(rows), EXPOSED_COLORS):
            widths = [getattr(r.exposed_parts, field) / tscale for r in rows]
            ax.barh([y + h for y in ys], widths, left=left, height=h, color=color, hatch="////", edgecolor="white",
                    lw=0, label=f"exposed: {name}", gid=f"time:exposed:{field}")
            left = [a + w for a, w in zip(left, widths)]
    ax.set_xlabel(f"time per step, per {words.unit} ({tunit})")
    ax.set_title("Time")
    ax.grid(True, axis="x", alpha=0.3)


# ---- predicted vs measured ----

@dataclass(frozen=True)
class MeasuredFigures:
    """What a Measurement says, reduced to what the comparison plot needs."""

    peak_bytes_per_rank: tuple[int, ...]
    step_time_samples_s: tuple[float, ...]
    step_time_s: float  # the median the executor reports

    @property
    def peak_bytes(self) -> int:
        return max(self.peak_bytes_per_rank)


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured: positive when the prediction is high."""
    return (predicted - measured) / measured


def plot_predicted_vs_measured(predicted_peak_bytes: int, predicted_step_time_s: float, measured: MeasuredFigures,
                               title: str = "") -> Figure:
    """Two panels: peak memory per GPU (predicted bar, measured max over ranks, each rank a dot) and
    step time (predicted, measured median with the min..max of the samples); the error in each title."""
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    ax_m, ax_t = fig.subplots(1, 2)

    scale, unit = byte_scale(max(predicted_peak_bytes, measured.peak_bytes))
    err_m = relative_error(predicted_peak_bytes, measured.peak_bytes)
    bars = ax_m.bar([0, 1], [predicted_peak_bytes / scale, measured.peak_bytes / scale], color=["#1f77b4", "#ff7f0e"],
                    width=0.6, gid="peak-bars")
    ax_m.bar_label(bars, fmt=f"%.2f {unit}", label_type="center", color="white", fontsize=9, fontweight="bold")
    ax_m.scatter([1] * len(measured.peak_bytes_per_rank), [b / scale for b in measured.peak_bytes_per_rank],
                 color="black", s=14, zorder=3, label="each rank", gid="peak-ranks")
    ax_m.set_xticks([0, 1], ["predicted", "measured\n(max over ranks)"])
    ax_m.set_ylabel(f"peak memory per GPU ({unit})")
    ax_m.set_title(f"Peak memory: error {err_m:+.1%}", fontsize=10)
    ax_m.set_ylim(0, max(predicted_peak_bytes, measured.peak_bytes) / scale * 1.25)  # room for the legend
    ax_m.legend(fontsize=8, loc="upper right")

    samples = measured.step_time_samples_s or (measured.step_time_s,)
    tscale, tunit = _time_scale(max(predicted_step_time_s, max(samples)))
    err_t = relative_error(predicted_step_time_s, measured.step_time_s)
    lo, hi = min(samples), max(samples)
    bars = ax_t.bar([0, 1], [predicted_step_time_s / tscale, measured.step_time_s / tscale],
                    color=["#1f77b4", "#ff7f0e"], width=0.6, gid="time-bars")
    ax_t.bar_label(bars, fmt=f"%.3g {tunit}", label_type="center", color="white", fontsize=9, fontweight="bold")
    ax_t.errorbar([1], [measured.step_time_s / tscale],
                  yerr=[[(measured.step_time_s - lo) / tscale], [(hi - measured.step_time_s) / tscale]],
                  color="black", capsize=5, label="min .. max of steps", gid="time-spread")
    ax_t.set_xticks([0, 1], ["predicted", "measured\n(median)"])
    ax_t.set_ylabel(f"step time ({tunit})")
    ax_t.set_title(f"Step time: error {err_t:+.1%}", fontsize=10)
    ax_t.set_ylim(0, max(predicted_step_time_s, hi) / tscale * 1.25)
    ax_t.legend(fontsize=8, loc="upper right")
    for ax in (ax_m, ax_t):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("\n".join(textwrap.wrap(title or "Predicted vs measured", 100)), fontsize=10)
    return fig


def frontier_point_count(fig: Figure) -> int:
    """Points on the frontier line of a :func:`plot_frontier` figure (for tests and checks)."""
    line = next(ln for ax in fig.axes for ln in ax.lines if ln.get_gid() == "frontier")
    return len(line.get_xdata())


__all__ = [
    "FrontierPoint", "MeasuredFigures", "Throughput", "budget_on_scale", "byte_scale", "draw_budget", "figure_png",
    "frontier_point_count",
    "plan_throughput",
    "plot_frontier", "plot_memory_at_peak", "plot_predicted_vs_measured", "plot_units",
    "relative_error", "unit_label",
]


# ---- plans run by tune ----

def plot_measured_plans(plan: Plan) -> Figure | None:
    """The plans ``shard-planner tune`` ran: measured (y) vs predicted (x) peak memory and step time, each
    plan its own marker in the legend, the diagonal where prediction = measurement. None when no run of
    the plan file has predictions to compare."""
    points = [m for m in plan.measurements
              if m.predicted_peak_bytes is not None and m.predicted_step_time_s is not None]
    if not points:
        return None
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    ax_m, ax_t = fig.subplots(1, 2)
    scale, unit = byte_scale(max(max(m.peak_bytes, m.predicted_peak_bytes) for m in points))
    tscale, tunit = _time_scale(max(max(m.step_time_s, m.predicted_step_time_s) for m in points))
    for i, m in enumerate(points):
        style = dict(marker="*", s=220, color="gold") if m.chosen else dict(
            marker=BASELINE_MARKERS[i % len(BASELINE_MARKERS)], s=60, color=BASELINE_COLORS[i % len(BASELINE_COLORS)])
        label = _wrap(m.description + (" (chosen)" if m.chosen and "chosen" not in m.description else ""), 70)
        ax_m.scatter([m.predicted_peak_bytes / scale], [m.peak_bytes / scale], edgecolors="black", linewidths=0.6,
                     zorder=3, label=label, gid=f"run:{m.description}", **style)
        ax_t.scatter([m.predicted_step_time_s / tscale], [m.step_time_s / tscale], edgecolors="black",
                     linewidths=0.6, zorder=3, **style)
    for ax, values, u in ((ax_m, [v for m in points for v in (m.peak_bytes, m.predicted_peak_bytes)], scale),
                          (ax_t, [v for m in points for v in (m.step_time_s, m.predicted_step_time_s)], tscale)):
        lo, hi = min(values) / u * 0.9, max(values) / u * 1.1
        ax.plot([lo, hi], [lo, hi], ls="--", color="#888888", lw=1, zorder=1, gid="diagonal")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.grid(True, alpha=0.3)
    ax_m.set_xlabel(f"predicted peak memory per GPU ({unit})")
    ax_m.set_ylabel(f"measured peak memory per GPU ({unit})")
    ax_m.set_title("Peak memory", fontsize=10)
    ax_t.set_xlabel(f"predicted step time ({tunit})")
    ax_t.set_ylabel(f"measured step time ({tunit})")
    ax_t.set_title("Step time", fontsize=10)
    fig.suptitle(f"Plans run by tune: measured vs predicted (dashed: equal), {_model_name(plan)}", fontsize=11)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return fig
