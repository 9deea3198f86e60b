"""Reports: plot content checked on the Figure objects, per-unit figures exact, HTML self-contained with
images and tables, Markdown with PNGs beside it, a report for every example model, CLI, progress line."""

import base64
import dataclasses
import io
import re


import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

from tests.models.report_fixtures import GIB, MIB, _module, make_estimate, make_plan, make_trace
from shard_planner.cli.main import main
from shard_planner.errors import UserError
from shard_planner.plan.measurement import Measurement, RankMemory, plan_fingerprint, save_measurement
from shard_planner.plan import (
    MEMORY_CATEGORIES, Cluster, FrontierPoint, MeasuredPoint, Mesh, ModelRef, Plan, Prefetch, Training, Unit,
    save_plan,
)
from shard_planner.hardware.profile import load_profile
from shard_planner.progress import Progress, progress, progress_enabled
from shard_planner.report import build_sections, write_report, write_sections
from shard_planner.report.budget import report_budget
from shard_planner.report.measured import measured_figures
from shard_planner.report.plots import (
    frontier_point_count, plan_throughput, plot_frontier, plot_measured_plans, plot_memory_at_peak,
    plot_predicted_vs_measured, plot_units,
)
from shard_planner.report.timeline import plot_memory_timeline
from shard_planner.report.render import summary_lines
from shard_planner.report.rows import unit_rows
from shard_planner.report.tables import frontier_table, measurements_table, to_markdown, units_table
from shard_planner.units import format_bytes

EXAMPLES = ("gpt2", "llama", "vit", "encdec", "unet")


# Plans name their model file relative to the repository root (examples/...), as the CLI is run.
pytestmark = pytest.mark.usefixtures("in_repository_root")


def drawn_texts(fig) -> list[Text]:
    """Every text the figure draws: suptitle, legends, and per axes its titles, labels, annotations and
    the tick labels of the ticks inside the view (the ones Axis.draw draws)."""
    texts = list(fig.texts) + [t for leg in fig.legends for t in leg.get_texts()]
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        if ax.get_legend() is not None:
            texts += ax.get_legend().get_texts()
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis._update_ticks():
                texts += [tick.label1, tick.label2]
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def texts_overlap(fig) -> list[tuple[str, str]]:
    """Drawn texts (titles, labels, tick labels, legends, annotations) that overlap another or stick out of
    the figure."""
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in drawn_texts(fig)]
    page = fig.bbox
    clipped = [(a, "outside the figure") for a, box in boxes
               if box.x0 < page.x0 - 1 or box.y0 < page.y0 - 1 or box.x1 > page.x1 + 1 or box.y1 > page.y1 + 1]
    return clipped + [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:]
                      if ba.overlaps(bb) and ba.width > 0 and bb.width > 0]


def gid_artists(fig, gid):
    return list({id(a): a for a in fig.findobj() if getattr(a, "get_gid", lambda: None)() == gid}.values())


def measurement(peaks=(30 * GIB, 31 * GIB), steps=(1.30, 1.25, 1.40), predicted=None, plan=None) -> Measurement:
    return Measurement(
        plan_fingerprint=plan_fingerprint(plan) if plan is not None else "0" * 16, model_path="examples/gpt2.py", world_size=len(peaks), mesh_shard=len(peaks),
        mesh_replicate=1, micro_batch=8, device="cuda", device_name="test", backend="nccl", torch_version="2.13",
        memory_method="cuda max_memory_allocated", memory=tuple(RankMemory(i, b) for i, b in enumerate(peaks)),
        step_time_s=steps, timing_method="cuda events", warmup_steps=2, losses=(1.0,) * 5,
        predicted_peak_bytes=predicted[0] if predicted else None,
        predicted_step_time_s=predicted[1] if predicted else None)


# ---- plots ----

def test_frontier_plot_content():
    plan = make_plan(8, budget_gib=42)  # usable 42 x 0.947 = 39.77 GiB (h100-80gb): the chosen 38 GiB fits
    fig = plot_frontier(plan, report_budget(plan))
    ax = fig.axes[0]
    assert frontier_point_count(fig) == len(plan.frontier) == 6
    assert "(GiB)" in ax.get_xlabel() and "(tokens/s" in ax.get_ylabel()
    (budget,) = gid_artists(fig, "budget")
    assert budget.get_xdata()[0] == pytest.approx(42.0)
    (usable,) = gid_artists(fig, "usable-budget")
    assert usable.get_xdata()[0] == pytest.approx(42.0 * 0.947)
    (chosen,) = gid_artists(fig, "chosen")
    tp = plan_throughput(plan)
    assert tuple(chosen.get_offsets()[0]) == pytest.approx((plan.predicted.peak_bytes / GIB, tp.of(plan.predicted.step_time_s)))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    for b in plan.baselines:  # every recipe has its own labelled marker
        assert len(gid_artists(fig, f"baseline:{b.description}")) == 1
        assert any(label.replace("\n", " ").startswith(b.description) for label in labels)
    assert "no reshard (ZeRO-2-like) (does not fit)" in [label.replace("\n", " ") for label in labels]
    assert len(gid_artists(fig, "frontier-over")[0].get_offsets()) == 1  # 43 GiB > 39.77 GiB usable: hollow
    assert not texts_overlap(fig)


def test_frontier_throughput_in_samples_without_tokens():
    plan = make_plan(4, predicted=False)
    plan = Plan(**{**plan.__dict__, "model": ModelRef("examples/vit.py", "f" * 16)})
    fig = plot_frontier(plan, report_budget(plan))
    assert "(samples/s" in fig.axes[0].get_ylabel()
    assert plan_throughput(plan).work_per_step == 8 * 8  # micro-batch x ranks
    assert not gid_artists(fig, "chosen")


def test_memory_timeline_content():
    plan = make_plan(8)
    est = make_estimate(plan)
    fig = plot_memory_timeline(est.memory, report_budget(plan))
    ax = fig.axes[0]
    used = [c for c in MEMORY_CATEGORIES if any(e.bytes_by_category[c] for e in est.memory.timeline)]
    assert len(ax.collections) == len(used)  # one stacked band per category that is ever non-zero
    (peak,) = gid_artists(fig, "peak")
    i = max(range(len(est.memory.timeline)), key=lambda k: est.memory.timeline[k].total_bytes)
    assert peak.get_xdata()[0] == i and peak.get_ydata()[0] == pytest.approx(est.memory.peak_bytes / GIB)
    assert gid_artists(fig, "budget")[0].get_ydata()[0] == pytest.approx(40.0)
    assert gid_artists(fig, "usable-budget")[0].get_ydata()[0] == pytest.approx(40.0 * 0.947)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"forward (shaded)", "backward (shaded)", "optimizer step (shaded)"} <= set(legend)  # phases named once
    assert not ax.texts  # nothing written over the data: every name is in the legend
    assert "(GiB)" in ax.get_ylabel()
    assert not texts_overlap(fig)


def test_memory_at_peak_without_trace():
    plan = make_plan(4)
    fig = plot_memory_at_peak(plan.predicted, report_budget(plan))
    widths = {a.get_gid(): a.get_width() for a in fig.findobj() if str(a.get_gid()).startswith("cat:")}
    assert sum(widths.values()) == pytest.approx(plan.predicted.peak_bytes / GIB)
    assert not texts_overlap(fig)


def test_unit_rows_exact_and_folded():
    plan = make_plan(32, checkpoint_every=0)
    trace = make_trace(32)
    rows = unit_rows(plan, trace, make_estimate(plan))
    assert [r.label for r in rows] == ["<root>", "wte", "blocks.0 .. blocks.31", "lm_head"]
    blocks = rows[2]
    assert blocks.count == 32 and blocks.param_count == 50_000_000
    assert blocks.sharded_param_bytes == 50_000_000 * 4 // 8  # fp32 as built, over 8 ranks
    assert blocks.unsharded_param_bytes == 50_000_000 * 2  # gathered in bf16
    assert blocks.activation_bytes == 300 * MIB * 8  # saved per sample x micro-batch 8
    assert rows[0].param_count == 2048  # the root owns ln_f (and the parameter-less ModuleList)
    assert rows[0].activation_bytes == 24 * MIB * 8  # ln_f's saved tensors
    assert blocks.compute_s == pytest.approx((0.020 + 0.021 + 0.022) / 3 + 0.040, rel=0.02)
    checkpointed = unit_rows(make_plan(4, checkpoint_every=1), make_trace(4))
    assert checkpointed[2].activation_checkpoint and checkpointed[2].activation_bytes == 24 * MIB * 8  # inputs only
    assert len(unit_rows(plan, trace, fold=False)) == len(plan.units)
    by_name = unit_rows(plan)  # no trace: blocks.<n> still fold by the shape of their names
    assert [r.label for r in by_name] == ["<root>", "wte", "blocks.0 .. blocks.31", "lm_head"]
    interleaved = unit_rows(make_plan(6, checkpoint_every=2), make_trace(6))
    assert [(r.label, r.count, r.activation_checkpoint) for r in interleaved[2:4]] == [
        ("blocks.0 .. blocks.4 (3 of 6)", 3, True), ("blocks.1 .. blocks.5 (3 of 6)", 3, False)]
    nested = make_plan(2, checkpoint_every=1)
    nested = Plan(**{**nested.__dict__, "units": nested.units + (Unit(("blocks.1.mlp",)),)})
    nested_trace = make_trace(2)
    mlp = _module("blocks.1.mlp", "MLP", "blocks.1", [], "mlp", 1000, saved=100 * MIB, inp=MIB)
    nested_trace = dataclasses.replace(nested_trace, modules=nested_trace.modules + (mlp,))
    rows = {r.label: r for r in unit_rows(nested, nested_trace, fold=False)}
    assert rows["blocks.1.mlp"].activation_bytes == 0  # recomputed with its checkpointed parent blocks.1
    assert rows["blocks.1"].param_count == 50_000_000  # the nested unit owns the MLP's parameters
    three = unit_rows(make_plan(3, checkpoint_every=2), make_trace(3))  # too short to interleave: one row each
    assert [r.label for r in three[2:5]] == ["blocks.0", "blocks.1", "blocks.2"]


def test_units_plot_content():
    plan = make_plan(8)
    rows = unit_rows(plan, make_trace(8), make_estimate(plan))
    fig = plot_units(rows)
    mem_ax, time_ax = fig.axes
    for gid in ("mem:sharded_param_bytes", "mem:unsharded_param_bytes", "mem:activation_bytes", "time:compute",
                "time:comm", "time:exposed:wait_s"):
        assert len(gid_artists(fig, gid)) == len(rows)  # one bar per row
    assert "(GiB)" in mem_ax.get_xlabel() or "(MiB)" in mem_ax.get_xlabel()
    assert "(ms)" in time_ax.get_xlabel()
    assert [t.get_text() for t in mem_ax.get_yticklabels()][2:4] == [  # every other block checkpointed
        "blocks.0 .. blocks.6 (4 of 8)  [AC]", "blocks.1 .. blocks.7 (4 of 8)"]
    assert not texts_overlap(fig)
    assert plot_units(unit_rows(plan)) is None  # no trace: no sizes to draw


def test_predicted_vs_measured_content():
    m = measurement(peaks=(30 * GIB, 32 * GIB), steps=(1.0, 1.2, 1.1))
    fig = plot_predicted_vs_measured(int(33.6 * GIB), 1.21, measured_figures(m),
                                     "Predicted vs measured: gpt2.py (2 ranks, cuda (NVIDIA H200), nccl; memory by "
                                     "cuda max_memory_allocated, time by cuda events)")
    ax_m, ax_t = fig.axes
    assert ax_m.get_title() == "Peak memory: error +5.0%"  # 33.6 vs 32 (max over ranks)
    assert ax_t.get_title() == "Step time: error +10.0%"  # 1.21 vs the median 1.1
    assert len(gid_artists(fig, "peak-ranks")[0].get_offsets()) == 2
    assert "(GiB)" in ax_m.get_ylabel() and "(s)" in ax_t.get_ylabel()
    assert not texts_overlap(fig)


# ---- budget: --mem and the usable part the planner fills ----

def test_usable_budget_line_drawn():
    """Every memory plot draws --mem and, dotted, the usable budget (h100-80gb: 94.7% of --mem), labelled."""
    plan = make_plan(8)
    budget = report_budget(plan)
    assert (budget.mem_bytes, budget.usable_bytes) == (40 * GIB, int(40 * GIB * 0.947))
    figs = (plot_frontier(plan, budget), plot_memory_timeline(make_estimate(plan).memory, budget),
            plot_memory_at_peak(plan.predicted, budget))
    for fig, vertical in zip(figs, (True, False, True)):
        (mem,), (usable,) = gid_artists(fig, "budget"), gid_artists(fig, "usable-budget")
        data = (lambda a: a.get_xdata()[0]) if vertical else (lambda a: a.get_ydata()[0])
        assert (data(mem), data(usable)) == pytest.approx((40.0, 37.88))
        labels = [t.get_text().replace("\n", " ") for t in fig.legends[0].get_texts()]
        assert "budget: --mem 40.00 GiB" in labels
        assert "usable 37.88 GiB: --mem less the 5.3% margin of the allocator simulation" in labels
        assert not texts_overlap(fig)
    beyond = Plan(**{**plan.__dict__, "cluster": dataclasses.replace(plan.cluster, mem_budget_bytes=100 * GIB)})
    device = load_profile("h100-80gb").memory_bytes  # --mem beyond the device: the device's memory is the cap
    assert report_budget(beyond).usable_bytes == int(device * 0.947)
    assert f"the device's {format_bytes(device)} less the 5.3% margin" in report_budget(beyond).usable_label


def test_peak_between_usable_and_mem_does_not_fit(tmp_path):
    """A peak of 38 GiB under --mem 40 GiB is over the 37.88 GiB usable: the table says NO, the plot marks
    the policy with an X ("does not fit") and the summary says so, even where the plan's flag says fits."""
    plan = make_plan(8, budget_gib=42)  # the chosen plan: 38 GiB (fits 42 x 0.947), then judged at --mem 40 GiB
    plan = Plan(**{**plan.__dict__, "cluster": Cluster(**{**plan.cluster.__dict__, "mem_budget_bytes": 40 * GIB})})
    between = FrontierPoint(38 * GIB, 1.30, "per block, no AC", fits=True)  # flagged as --mem alone judged it
    plan = Plan(**{**plan.__dict__, "baselines": plan.baselines + (between,)})
    budget = report_budget(plan)
    assert budget.usable_bytes < 38 * GIB < budget.mem_bytes
    table = frontier_table(plan, budget).set_index("plan")["fits the usable budget"]
    assert table["chosen plan"] == "NO" and table["per block, no AC"] == "NO"
    assert table["Accelerate TRANSFORMER_BASED_WRAP"] == "yes"  # 36.5 GiB: within 37.88
    labels = [t.get_text().replace("\n", " ") for t in plot_frontier(plan, budget).legends[0].get_texts()]
    assert "per block, no AC (does not fit)" in labels
    assert any(label.startswith("chosen plan: 38.00 GiB") and label.endswith("(does not fit)") for label in labels)
    summary = dict(summary_lines(plan, budget))
    assert summary["predicted peak"] == "38.00 GiB per GPU (100% of the usable budget, 37.88 GiB): DOES NOT FIT"
    assert summary["cluster"].endswith(
        "budget --mem 40.00 GiB per GPU, 37.88 GiB usable (--mem less the 5.3% margin of the allocator simulation)")
    # The fastest policy within 37.88 GiB (34 GiB, 1.38 s), not the faster one at 38 GiB (1.30 s).
    assert summary["vs recipes"].endswith("that fits (torchtitan default (per block, reshard))")
    md = (write_report(plan, tmp_path).parent / "report.md").read_text()
    assert "| chosen | chosen plan | 38.0 | 1.270 | 51,603 | NO |" in md


def test_report_without_the_plans_profile(tmp_path, caplog):
    """A plan naming a profile that is not here: the report compares with --mem alone and says so."""
    plan = make_plan(8)
    plan = Plan(**{**plan.__dict__, "cluster": dataclasses.replace(plan.cluster, profile="/elsewhere/gpu.toml")})
    budget = report_budget(plan)
    assert budget.usable_bytes == budget.mem_bytes == 40 * GIB and not budget.has_usable
    sections = build_sections(plan, trace=make_trace(8))  # no profile to estimate with: the plan's peak only
    assert [s.image for s in sections][:2] == ["frontier.png", "memory_at_peak.png"]
    frontier = sections[0]
    assert not gid_artists(frontier.figure, "usable-budget") and gid_artists(frontier.figure, "budget")
    assert "compared with --mem alone" in frontier.caption and "/elsewhere/gpu.toml" in frontier.caption
    assert "fits --mem" in frontier.table.columns and "--profile" in sections[1].caption
    html = write_report(plan, tmp_path).read_text()
    assert "compared with --mem alone" in html


# ---- tables ----

def test_tables_and_markdown():
    plan = make_plan(8, budget_gib=42)
    df = frontier_table(plan, report_budget(plan))
    assert len(df) == 1 + len(plan.frontier) + len(plan.baselines)
    assert list(df.columns) == ["kind", "plan", "peak (GiB)", "step time (s)", "throughput (tokens/s)",
                                "fits the usable budget"]
    md = to_markdown(df)
    lines = md.splitlines()
    assert len(lines) == len(df) + 2 and lines[1].startswith("|---|---|---:|")
    assert "| chosen | chosen plan | 38.0 | 1.270 | 51,603 | yes |" in md
    assert "| NO |" in md  # the baseline over the budget
    units = units_table(unit_rows(make_plan(4, checkpoint_every=0, frontier=0), make_trace(4)))
    assert list(units["count"]) == [1, 1, 4, 1]
    assert "sharded params/rank (MiB)" in units.columns


# ---- the report ----

def test_write_report_self_contained(tmp_path):
    plan = make_plan(16, group=2, checkpoint_every=0)
    est = make_estimate(plan)
    m = measurement(predicted=(plan.predicted.peak_bytes, plan.predicted.step_time_s), plan=plan.with_world_size(2))
    html_path = write_report(plan, tmp_path / "r", trace=make_trace(16), estimate=est, measurement=m)
    html = html_path.read_text()
    pngs = sorted(p.name for p in (tmp_path / "r").glob("*.png"))
    assert pngs == ["frontier.png", "memory_timeline.png", "predicted_vs_measured.png", "units.png"]
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(embedded) == len(pngs)
    assert all(base64.b64decode(e).startswith(b"\x89PNG") for e in embedded)
    assert not re.search(r'(src|href)="(?!data:)', html), "report.html must not load anything"
    assert html.count("<table") == 3  # summary, frontier, units
    assert "prediction error" in html and "torchtitan default" in html
    md = (tmp_path / "r" / "report.md").read_text()
    for png in pngs:
        assert f"]({png})" in md
    assert md.count("\n|---") >= 3 and "| blocks.0..blocks.1 .. blocks.14..blocks.15 |" in md


def test_write_report_from_plan_alone(tmp_path):
    plan = make_plan(4)
    write_report(plan, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["frontier.png", "memory_at_peak.png"]
    alone = Plan(**{**plan.__dict__, "frontier": (), "baselines": ()})
    assert plot_frontier(alone, report_budget(alone)) is None  # a single point is not a trade-off
    bare = Plan(**{**plan.__dict__, "predicted": None, "frontier": (), "baselines": ()})
    html = write_report(bare, tmp_path / "bare").read_text()
    assert "data:image" not in html and "<table" in html  # nothing to draw: the units table still renders


def test_plans_run_by_tune(tmp_path):
    plan = make_plan(8)
    runs = ((True, 37.1, 1.31, 38.0, 1.27), (False, 27.5, 1.45, 28.0, 1.41), (False, 33.0, 1.36, None, None))
    long = "4+root units, reshard F:4, AC 0, pf 0/1, mb 8, and a description as long as tune writes them"
    points = tuple(MeasuredPoint(f"plan {i}" if i else f"plan 0 {long}", "0" * 16, 8, int(pk * GIB), st,
                                 int(pp * GIB) if pp else None, ps, chosen=c)
                   for i, (c, pk, st, pp, ps) in enumerate(runs))
    plan = Plan(**{**plan.__dict__, "measurements": points})
    fig = plot_measured_plans(plan)
    assert len(gid_artists(fig, f"run:plan 0 {long}")) == 1 and not gid_artists(fig, "run:plan 2")  # no prediction: no point
    assert "(GiB)" in fig.axes[0].get_xlabel() and "(s)" in fig.axes[1].get_ylabel()
    assert not texts_overlap(fig)
    md = to_markdown(measurements_table(plan))
    assert f"| plan 0 {long} (chosen) | 8 | 38.0 | 37.1 | +2.4 | 1.270 | 1.310 | -3.1 |" in md
    assert "| plan 2 | 8 |  | 33.0 |  |" in md
    write_report(plan, tmp_path)
    assert (tmp_path / "tune_runs.png").exists()


def test_measurement_from_another_world_size_is_not_compared(tmp_path):
    plan = make_plan(4)
    m = Measurement(**{**measurement(plan=plan.with_world_size(2)).__dict__, "rederived_from_world_size": 8})
    titles = [s.title for s in build_sections(plan, measurement=m)]
    assert "Measured" in titles and "Predicted vs measured" not in titles
    with pytest.raises(UserError, match="measurement is of another plan"):
        build_sections(plan, measurement=measurement(plan=make_plan(5).with_world_size(2)))


def _example_plan(trace, path):
    """A plan for an example: one unit per block of its ModuleLists, every other one checkpointed."""
    blocks = [m.fqn for m in trace.modules if m.parent is not None and trace.module(m.parent).type_name == "ModuleList"
              and trace.subtree_param_count(m.fqn) > 0]
    blocks = [b for b in blocks if not any(b.startswith(o + ".") for o in blocks)]  # outermost only
    units = [Unit(("",), reshard_after_forward=False)] + [Unit((b,), True, i % 2 == 0) for i, b in enumerate(blocks)]
    return Plan(ModelRef(path, trace.fingerprint, trace.tokens_per_sample), Cluster(8, 8, "h100-80gb", 8 * GIB),
                Mesh(8), Training(micro_batch=2), tuple(units), Prefetch(1, 1))


@pytest.fixture(scope="module")
def example_traces():
    from shard_planner.trace.tracer import trace_model

    return {name: trace_model(f"examples/{name}.py") for name in EXAMPLES}


@pytest.mark.parametrize("name", EXAMPLES)
def test_report_for_every_example(name, example_traces, tmp_path):
    """The solver's plan for each example (frontier, hand-written policies, chosen plan: real planner
    output), and a multi-unit plan of the same model estimated by the cost model (tiny models fit
    unsharded, so the solver's own plan is often the root alone): both reports render, with every
    parameter in exactly one unit and no overlapping text."""
    from shard_planner.cost import estimate as estimate_fn
    from shard_planner.hardware.profile import load_profile
    from shard_planner.solve import PlanRequest, plan_model

    trace, path = example_traces[name], f"examples/{name}.py"
    profile = load_profile("h100-80gb")
    solved = plan_model(trace, PlanRequest(gpus=8, mem_budget_bytes=8 * GIB, profile=profile, model_path=path, time_limit_s=5)).plan
    hand = _example_plan(trace, path)
    assert len(hand.units) > 2, "the example has blocks to shard"
    hand_estimate = estimate_fn(trace, hand, profile)
    hand = Plan(**{**hand.__dict__, "predicted": hand_estimate.prediction(), "frontier": solved.frontier,
                   "baselines": solved.baselines})
    for plan, estimate, out in ((solved, None, tmp_path / "solved"), (hand, hand_estimate, tmp_path / "hand")):
        sections = build_sections(plan, trace=trace, profile=profile, estimate=estimate)
        for section in sections:
            if section.figure is not None and (plan is hand or section.image == "frontier.png"):
                assert not texts_overlap(section.figure), (name, section.title)  # real labels, real numbers
        html = write_sections(plan, sections, out).read_text()
        assert html.count("data:image/png;base64,") == 3 and "<table" in html  # frontier, timeline, units
        assert {p.name for p in out.glob("*.png")} == {"frontier.png", "memory_timeline.png", "units.png"}
        rows = unit_rows(plan, trace, estimate_fn(trace, plan, profile))
        assert sum(r.param_count * r.count for r in rows) == trace.param_count  # every parameter in one unit
        frontier = next(s.figure for s in sections if s.image == "frontier.png")
        assert frontier_point_count(frontier) == len(solved.frontier)
    # The report's fits agree with the solver's, which judged the same usable budget (8 GiB x 0.947) and, each
    # point within it, the allocator simulation (solve/context.py shown_fits): a NO of the solver's stays NO.
    table = frontier_table(solved, report_budget(solved, profile))
    points = sorted(solved.frontier, key=lambda q: q.peak_bytes)
    assert list(table["fits the usable budget"]) == ["yes"] + ["yes" if q.fits else "NO" for q in points] + [
        "yes" if b.fits else "NO" for b in solved.baselines]


# ---- CLI ----

def test_report_cli(tmp_path, capsys):
    plan = make_plan(8)
    save_plan(plan, tmp_path / "plan.json")
    m = measurement(predicted=(plan.predicted.peak_bytes, plan.predicted.step_time_s), plan=plan.with_world_size(2))
    save_measurement(m, tmp_path / "measurement.json")
    out = tmp_path / "out"
    assert main(["report", str(tmp_path / "plan.json"), str(tmp_path / "measurement.json"), "-o", str(out),
                 "--no-trace"]) == 0
    assert "report.html" in capsys.readouterr().out
    assert (out / "predicted_vs_measured.png").exists() and (out / "report.md").exists()
    # The plan's model file is not here: one clear line, non-zero exit.
    gone = Plan(**{**plan.__dict__, "model": ModelRef("/nowhere/model.py", plan.model.fingerprint)})
    save_plan(gone, tmp_path / "gone.json")
    assert main(["report", str(tmp_path / "gone.json"), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shard-planner: error:") and "--no-trace" in err and len(err.splitlines()) == 1


def test_report_cli_traces_the_plans_model(tmp_path, example_traces, capsys):
    trace = example_traces["gpt2"]
    (tmp_path / "trace.json").write_text(trace.to_json())
    plan = _example_plan(trace, "examples/gpt2.py")
    save_plan(plan, tmp_path / "plan.json")
    assert main(["report", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "trace.json"),
                 "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "units.png").exists()
    # Without --trace the plan's own model file is traced (examples/gpt2.py, from the repository root).
    assert main(["report", str(tmp_path / "plan.json"), "-o", str(tmp_path / "default")]) == 0
    assert (tmp_path / "default" / "memory_timeline.png").exists()
    wrong = Plan(**{**plan.__dict__, "model": ModelRef("examples/gpt2.py", "0" * 16, 64)})
    save_plan(wrong, tmp_path / "wrong.json")
    assert main(["report", str(tmp_path / "wrong.json"), "--trace", str(tmp_path / "trace.json"),
                 "-o", str(tmp_path / "out2")]) == 2
    assert "not the model the plan was made for" in capsys.readouterr().err


# ---- progress ----

class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_on_a_terminal(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    stream = _Tty()
    clock = iter(range(100))
    p = Progress("solving", total=4, stream=stream, clock=lambda: float(next(clock)))
    assert p.enabled
    for _ in range(4):
        p.advance(detail="budget")
    p.close()
    text = stream.getvalue()
    assert text.startswith("\rsolving: 1/4 [ 25%]") and text.endswith("\n")
    assert "\rsolving: 4/4 [100%]" in text


def test_progress_without_a_total_shows_no_count_until_one_moves():
    clock = iter([0.0, 2.0, 2.5])
    p = Progress("tracing m.py", stream=_Tty(), enabled=False, clock=lambda: next(clock))
    assert p.line() == "tracing m.py: 2.0s"  # uncounted work: elapsed time only, no count stuck at 0
    p.advance(2)
    assert p.line() == "tracing m.py: 2 2.5s"


def test_progress_quiet_in_ci_and_pipes(monkeypatch):
    monkeypatch.setenv("CI", "1")
    stream = _Tty()
    with progress("tracing", total=3, stream=stream) as p:
        p.advance(3)
    assert stream.getvalue() == "" and p.done == 3
    monkeypatch.delenv("CI")
    assert not progress_enabled(io.StringIO())  # piped: not a terminal
    assert progress_enabled(_Tty())


def test_progress_finishes_the_line_on_error(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    stream = _Tty()
    with pytest.raises(RuntimeError):
        with progress("running steps", stream=stream) as p:
            p.advance()
            raise RuntimeError("boom")
    assert stream.getvalue().endswith("\n") and "running steps: 1" in stream.getvalue()

