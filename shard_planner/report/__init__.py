"""Reports: the pictures and tables people review before they spend a cluster on a plan.

    write_report(plan, "reports/gpt2/", trace=trace, profile=profile, measurement=m) -> .../report.html

writes into the folder:

- ``report.html``: self-contained (every PNG embedded as a ``data:image/png;base64`` URI, CSS inline), so
  it opens offline in any browser and can be mailed as one file;
- ``report.md``: the same content, with the PNGs beside it;
- the PNGs: ``frontier.png`` (memory vs throughput), ``layouts.png`` (the same per layout, each tensor-parallel
  degree, when the plan searched more than one: report/layouts.py), ``memory_timeline.png`` (the chosen plan over one
  step: report/timeline.py; ``memory_at_peak.png`` when there is no trace to simulate), ``units.png`` (per-unit bars, with a
  trace), ``predicted_vs_measured.png`` (with a measurement), ``tune_runs.png`` (plans ``tune`` ran).

With a trace (and a profile, loaded from the plan's profile name when not given) the cost model is run
once on the plan for the timeline and the per-unit times; without, the report draws what the plan file
holds. A caller that already has the estimate passes it as ``estimate=`` (``shard-planner plan`` passes
the planner's, ``PlanResult.estimate``, so the cost model runs once per command).

[Note: One rank's trace]
  Every per-unit figure, the memory timeline and the allocator's line are one rank's, so the trace they
  come from must be one rank's at the plan's tensor-parallel degree (trace ``tp_size``), the trace the
  planner priced the plan on: ``plan`` passes the chosen layout's (cli/plan_degrees.py
  ``DegreeWork.trace_of``), ``report`` traces the plan's model at its degree (trace/tracer.py
  ``trace_for_plan``). A trace of the whole model drawn for a TP plan reads every split block at its full
  size; :func:`check_trace_rank` refuses it. Both commands write the report with :func:`write_report`.

The words for what the plan's engine does (FSDP2's units, reshard, sharded and gathered parameters and
collectives; on one device, regions and the parameters it holds, nothing communicated) are report/engine_words.py's,
which every section asks, so that a single-device plan's report names nothing FSDP2 does.

Memory is judged against the usable budget the planner fills, --mem x the profile's usable_fraction
(report/budget.py); both lines are drawn. On a GPU profile the timeline draws the simulated CUDA caching
allocator's reserved bytes too (report/reserved.py), and the summary its figures from the plan file. When the plan's profile is not here the report compares
with --mem alone, draws no timeline, and says so.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from shard_planner.cost.types import Estimate
from shard_planner.errors import PlanError
from shard_planner.fileio import write_atomic
from shard_planner.parallel.mesh import ModelSplit
from shard_planner.plan import Plan
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.report.budget import ReportBudget, load_plan_profile, report_budget
from shard_planner.report.engine_words import FSDP2_WORDS, EngineWords, engine_words
from shard_planner.report.layouts import layouts_table, plot_layouts, throughput_unit
from shard_planner.report.measured import check_measurement_matches, measured_figures, predictions_for, run_sections
from shard_planner.report.plots import (
    category_labels, figures_png, plot_frontier, plot_measured_plans, plot_memory_at_peak, plot_predicted_vs_measured,
    plot_units,
)
from shard_planner.report.reserved import reserved_caption, reserved_timeline
from shard_planner.report.render import ReportSection, render_html, render_markdown, summary_lines
from shard_planner.report.rows import unit_rows
from shard_planner.report.tables import exposed_parts_text, frontier_table, measurements_table, units_table
from shard_planner.report.timeline import plot_memory_timeline
from shard_planner.trace.types import ModelTrace
from shard_planner.units import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Renderer = Callable[[dict[str, "Figure"]], dict[str, bytes]]  # figures by file name -> PNG bytes

logger = logging.getLogger(__name__)

__all__ = ["build_sections", "check_trace_rank", "write_report", "write_sections"]


def _estimate(plan: Plan, trace: ModelTrace, profile: HardwareProfile | None) -> Estimate | None:
    try:
        from shard_planner.cost import estimate  # imported late: the report draws what it can without it
    except ImportError:
        logger.warning("the cost model (shard_planner.cost.estimate) is not available: no memory timeline")
        return None
    if profile is None:
        profile, why = load_plan_profile(plan)
        if profile is None:
            logger.warning("no profile to run the cost model with (%s): no memory timeline", why)
            return None
    return estimate(trace, plan, profile)


def _budget_text(budget: ReportBudget, fig=None) -> str:
    """What the budget lines of a memory plot (``fig``) are, for its caption; where the plot is zoomed to its
    data (report/plots.py [Note: Zoom to the data]), that the budget is off its scale."""
    if fig is not None and any(getattr(a, "get_gid", lambda: None)() == "budget-off-scale" for a in fig.findobj()):
        return (f"The budget, {budget.describe()}, is off this plot's scale: the axis is zoomed to the data, which "
                "stay under half of it (the legend names the budget).")
    if budget.has_usable and budget.device == "cuda":
        return (f"The dashed line is --mem ({format_bytes(budget.mem_bytes)} per {budget.rank_word}); the dotted one the most the "
                f"planner lets a plan allocate, {format_bytes(budget.usable_bytes)}: {budget.usable_reason}; what "
                "fits is decided by the simulated CUDA caching allocator (its reserved memory exceeds what it "
                "hands out).")
    if budget.has_usable:
        return (f"The dashed line is --mem ({format_bytes(budget.mem_bytes)} per {budget.rank_word}); the dotted one the usable "
                f"budget the planner fills, {format_bytes(budget.usable_bytes)}: {budget.usable_reason}.")
    if budget.missing_profile:
        return f"The dashed line is --mem ({format_bytes(budget.mem_bytes)} per {budget.rank_word}), {budget.fallback_note}."
    return (f"The dashed line is --mem ({format_bytes(budget.mem_bytes)} per {budget.rank_word}); the profile keeps none of it "
            "free.")


def build_sections(plan: Plan, *, trace: ModelTrace | None = None, profile: HardwareProfile | None = None,
                   measurement=None, estimate: Estimate | None = None,
                   budget: ReportBudget | None = None) -> list[ReportSection]:
    """The report's sections in order, each with its figure (if any) and table (if any). ``budget``:
    :func:`report_budget` of the plan and ``profile`` when not given."""
    if trace is not None:
        check_trace_rank(plan, trace)
    if budget is None:
        missing = ""
        if profile is None:
            profile, missing = load_plan_profile(plan)
        budget = report_budget(plan, profile, missing)
    if estimate is None and trace is not None:
        if profile is None and budget.missing_profile:
            logger.warning("no memory timeline: the cost model needs the plan's profile (give --profile)")
        else:
            estimate = _estimate(plan, trace, profile)
    reserved = reserved_timeline(plan, trace, profile) if estimate is not None else None
    sections = [_frontier_section(plan, budget), _layouts_section(plan, budget),
                _memory_section(plan, trace, estimate, budget, reserved),
                _units_section(plan, trace, estimate, budget)]
    if plan.measurements:
        sections.append(_tune_section(plan))
    if measurement is not None:
        sections.append(_measured_section(plan, measurement))
        sections += run_sections(measurement)
    sections.append(ReportSection("Use the plan", None, None, engine_words(plan).use))
    return [s for s in sections if s is not None]


def check_trace_rank(plan: Plan, trace: ModelTrace) -> None:
    """``trace`` is one rank's at ``plan``'s tensor-parallel degree ([Note: One rank's trace]), else one line."""
    if trace.tp_size != plan.mesh.tp_size:
        raise PlanError(f"the trace holds one rank at {ModelSplit(tp=trace.tp_size).label} where the plan runs "
                        f"{plan.mesh.split.label}: give the model file (--trace MODEL), which is traced "
                        "at the plan's degree, or --no-trace")


def _frontier_section(plan: Plan, budget: ReportBudget) -> ReportSection | None:
    """Memory vs throughput: the frontier, the chosen plan and the recipes (None without
    a point to compare with)."""
    fig = plot_frontier(plan, budget)
    if fig is None:
        return None
    judged = "the usable budget" if budget.has_usable else "--mem"
    degree = (f" at the chosen layout ({plan.mesh.split.label}; every layout: Layouts, below)"
              if plan.layouts else "")
    return ReportSection(
        "Memory vs throughput", "frontier.png", fig,
        f"Each point is a plan of the same model, micro-batch and cluster{degree}, as the cost model predicts it. "
        "The line joins the Pareto frontier (no other plan is both smaller and faster); the star is the "
        "chosen plan; the other markers are the recipes people run (shard_planner/plan/recipes.py; an X: over "
        f"{judged}; a hollow frontier point too). {_budget_text(budget, fig)} The table's fits column is "
        f"against {judged}.",
        frontier_table(plan, budget))


def _layouts_section(plan: Plan, budget: ReportBudget) -> ReportSection | None:
    """Every layout (split of the model over ranks) the planner searched, drawn and tabled (report/layouts.py);
    None for a plan of one layout (--tp given, a CPU profile, a plan from before the layout search)."""
    if not plan.layouts:
        return None
    layouts = ", ".join(f"{o.label} ({o.judged})" for o in plan.layouts)
    work = throughput_unit(plan).removesuffix("/s")  # tokens or samples
    fig = plot_layouts(plan, budget)
    return ReportSection(
        "Layouts", "layouts.png", fig,
        f"The planner chose how the model is split over ranks too, here its tensor-parallel degree: {layouts}; "
        f"{plan.mesh.split.label} chosen. Every degree of 1, 2, 4 and 8 that divides the GPUs per node is "
        "screened (its heuristic plans and the recipes at each micro-batch) and those close to the best screened "
        "one are searched in full (solve/layout_search.py [Note: Screening the layouts]). Each line is a searched "
        "layout's Pareto frontier, a hollow diamond a layout screened only (its fastest heuristic plan: a full "
        "search finds at least that), the star the chosen plan; a refused layout is in the table only, with why. "
        f"A layout's throughput is its own global batch (micro-batch x accumulation x data-parallel ranks) in "
        f"{work} over its step time, the whole cluster's. Why a layout wins or loses (memory, the global batch, "
        "exposed communication, the tensor-parallel collectives) is the summary's layouts line, from the table's "
        f"figures (solve/layout_search.py [Note: Why a layout wins or loses]). {_budget_text(budget, fig)}",
        layouts_table(plan))


def _memory_section(plan: Plan, trace: ModelTrace | None, estimate: Estimate | None,
                    budget: ReportBudget, reserved=None) -> ReportSection | None:
    """The chosen plan's memory over one step (with an estimate; on a GPU with the allocator's reserved
    bytes beside it, ``reserved``: report/reserved.py), else at its peak (from the plan file)."""
    words = engine_words(plan)
    labels = category_labels(words)
    if estimate is not None:
        fig = plot_memory_timeline(estimate.memory, budget, f"Memory over one training step: {_model_name(plan)}, "
                                   f"chosen plan (predicted, per {budget.rank_word})", reserved, labels=labels)
        return ReportSection(
            "Memory over one step", "memory_timeline.png", fig,
            f"Live bytes on one {budget.rank_word} after each event of {words.schedule}, stacked by "
            "category (allocated). "
            f"{_budget_text(budget, fig)} {reserved_caption(reserved)}".rstrip())
    if plan.predicted is None:
        return None
    fig = plot_memory_at_peak(plan.predicted, budget, labels=labels)
    return ReportSection(
        "Memory at the peak", "memory_at_peak.png", fig,
        "The plan's predicted memory at its peak, by category (re-run with the model or its trace"
        + (" and a profile (--profile)" if budget.missing_profile and trace is not None else "")
        + f" for the whole timeline). {_budget_text(budget, fig)}")


def _units_section(plan: Plan, trace: ModelTrace | None, estimate: Estimate | None,
                   budget: ReportBudget) -> ReportSection:
    words = engine_words(plan)
    rows = unit_rows(plan, trace, estimate)
    fig = plot_units(rows, rank_word=budget.rank_word, words=words)
    exposed = exposed_parts_text(rows) if words.shards else ""  # no communication on one device
    unit = words.unit
    return ReportSection(
        f"{unit.capitalize()}s", "units.png" if fig is not None else None, fig,
        f"One row per {words.unit_long} in forward order; consecutive {unit}s of the same block are folded into one "
        f"row per decision ({words.decisions}), with their count and figures per {unit} (\"N of M\": every "
        f"other block, say). Memory is per {budget.rank_word} at the plan's micro-batch; times are per step."
        + (f" {words.root}" if words.root else "")
        + (" " + exposed if exposed else "")
        + (" " + fine_tune_text(trace, words) if trace is not None and trace.has_frozen_params else ""),
        units_table(rows, words))


def fine_tune_text(trace: ModelTrace, words: EngineWords = FSDP2_WORDS) -> str:
    """A fine-tune's parameters: trainable, frozen and quantised (what NF4 weights store: codes, scalers,
    factors; ``ModuleTrace.quantized_param_bytes_by_dtype``) bytes as built, and what the plan's engine
    (``words``) does with the frozen ones."""
    trainable = sum(m.trainable_param_bytes for m in trace.modules)
    frozen = sum(m.frozen_param_bytes for m in trace.modules)
    quantised = sum(sum(m.quantized_param_bytes_by_dtype.values()) for m in trace.modules)
    return (f"Fine-tune: {trace.trainable_param_count:,} of {trace.param_count:,} parameters train "
            f"({format_bytes(trainable)} as built); {format_bytes(frozen)} are frozen"
            + (f", {format_bytes(quantised)} of them quantised" if quantised else "")
            + f": {words.frozen}.")


def _tune_section(plan: Plan) -> ReportSection:
    fig = plot_measured_plans(plan)
    return ReportSection(
        "Plans run by tune", "tune_runs.png" if fig is not None else None, fig,
        "Plans shard-planner tune ran for real, each at the world size it ran on: measured peak (largest over "
        "ranks) and median step time against the cost model's prediction for that run. "
        "Error = (predicted - measured) / measured.",
        measurements_table(plan))


def _measured_section(plan: Plan, measurement) -> ReportSection:
    """Predicted vs measured for a run of this plan; the measured figures alone for a run at another
    world size (the plan's prediction does not apply to it)."""
    check_measurement_matches(plan, measurement)
    figures, predicted = measured_figures(measurement), predictions_for(plan, measurement)
    ran_on = f"{measurement.world_size} ranks, {measurement.device} ({measurement.device_name}), {measurement.backend}"
    where = f"{ran_on}; memory by {measurement.memory_method}, time by {measurement.timing_method}"
    if predicted is not None:
        return ReportSection(
            "Predicted vs measured", "predicted_vs_measured.png",
            plot_predicted_vs_measured(*predicted, figures, f"Predicted vs measured: {_model_name(plan)} ({ran_on})"),
            "Error = (predicted - measured) / measured. Measured peak is the largest over ranks; measured "
            f"step time is the median of {len(figures.step_time_samples_s)} steps after "
            f"{measurement.warmup_steps} warm-up steps. Run: {where}.")
    return ReportSection(
        "Measured", None, None,
        f"Measured peak {format_bytes(figures.peak_bytes)} per rank, step time {figures.step_time_s:.4g} s "
        f"(median). The run used {measurement.world_size} ranks instead of the plan's "
        f"{plan.cluster.gpus}, so the plan's prediction does not apply to it. Run: {where}.")


def _model_name(plan: Plan) -> str:
    return plan.model.path.rsplit("/", 1)[-1]


def write_report(plan: Plan, out_dir: str | os.PathLike, *, trace: ModelTrace | None = None,
                 profile: HardwareProfile | None = None, measurement=None,
                 estimate: Estimate | None = None, render: Renderer = figures_png) -> Path:
    """Write report.html, report.md and the PNGs into ``out_dir``; return the path of report.html.
    ``render``: the figures (by file name) to PNG bytes (the CLI renders some in a helper process)."""
    missing = ""
    if profile is None:
        profile, missing = load_plan_profile(plan)
    budget = report_budget(plan, profile, missing)
    sections = build_sections(plan, trace=trace, profile=profile, measurement=measurement, estimate=estimate,
                              budget=budget)
    return write_sections(plan, sections, out_dir, measurement=measurement, budget=budget, render=render, trace=trace)


def write_sections(plan: Plan, sections: list[ReportSection], out_dir: str | os.PathLike, *,
                   measurement=None, budget: ReportBudget | None = None, render: Renderer = figures_png,
                   trace: ModelTrace | None = None) -> Path:
    """Write already built sections (:func:`build_sections`) as the report; return report.html's path.
    ``budget``: the one the sections were built with (None: :func:`report_budget` of the plan's profile);
    ``trace``: theirs, for the summary's line of what trains."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = render({s.image: s.figure for s in sections if s.figure is not None})
    for name, png in pngs.items():
        write_atomic(out / name, png)
    measured = None
    predicted = predictions_for(plan, measurement) if measurement is not None else None
    if predicted is not None:
        measured = (measured_figures(measurement), predicted)
    budget = budget if budget is not None else report_budget(plan)
    summary = summary_lines(plan, budget, measured, trace)
    write_atomic(out / "report.md", render_markdown(plan, summary, sections, budget))
    html_path = out / "report.html"
    write_atomic(html_path, render_html(plan, summary, sections, pngs, budget))
    logger.info("report written to %s", html_path)
    return html_path

