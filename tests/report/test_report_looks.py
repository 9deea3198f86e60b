"""The report as a reader sees it (issue 36 item 9): one reserved figure per plan, axes zoomed to the data of a
tiny model with the budget marked off scale, no text outside its axes or over the data, the chosen star under
the hand-written policies' markers, text columns left-aligned, the fine-tuning named in the summary, durations
never in exponent form."""

import dataclasses
import re

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from shard_planner.plan import Plan
from shard_planner.parallel.mesh import ModelSplit
from shard_planner.plan.points import LayoutOutcome, layout_lines
from shard_planner.hardware.profile import load_profile
from shard_planner.report import build_sections
from shard_planner.report.budget import report_budget
from shard_planner.report.plots import plot_frontier
from shard_planner.report.render import summary_lines
from shard_planner.report.tables import frontier_table, to_html
from shard_planner.report.timeline import plot_memory_timeline
from shard_planner.units import format_bytes, format_duration
from tests.models.report_fixtures import GIB, make_plan
from tests.report.test_accumulation_report import LAST, _stack_plan
from tests.report.test_report import _example_plan, gid_artists, texts_overlap

pytestmark = pytest.mark.usefixtures("in_repository_root")


@pytest.fixture(scope="module")
def gpt2():
    from shard_planner.cost import CostModel
    from shard_planner.trace.tracer import trace_model

    trace = trace_model("examples/gpt2.py")
    profile = load_profile("h100-80gb")
    return trace, profile, CostModel(trace, profile)


def _predicted(cm, plan: Plan) -> Plan:
    """``plan`` with the prediction ``plan`` writes: the cost model's, the allocator's figures on --mem."""
    from shard_planner.cost.fits import device_fit

    fit = device_fit(cm, plan)
    return dataclasses.replace(plan, predicted=fit.priced(cm.estimate(plan).prediction()))


def _retrying_plan(cm, trace) -> Plan:
    """A GPT-2 plan whose step survives --mem only with allocator retries (micro-batch 512, --mem just
    under what the allocator would reserve unlimited)."""
    from shard_planner.cost.fits import device_fit

    plan = _example_plan(trace, "examples/gpt2.py")
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, micro_batch=512))
    unlimited = device_fit(cm, plan).reserved_peak_total_bytes
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, mem_budget_bytes=int(
        0.96 * unlimited / 0.947)))
    assert device_fit(cm, plan).retries_per_step > 0
    return _predicted(cm, plan)


def test_one_reserved_figure_per_plan(gpt2):
    """The summary's reserved peak is the memory plot's (its legend and its line), retries or not."""
    trace, profile, cm = gpt2
    plan = _retrying_plan(cm, trace)
    memory = next(s for s in build_sections(plan, trace=trace, profile=profile) if s.image == "memory_timeline.png")
    figure = format_bytes(plan.predicted.reserved_peak_bytes)
    legend = [t.get_text() for t in memory.figure.legends[0].get_texts() if t.get_text().startswith("reserved")]
    assert [re.findall(r"\d+\.\d+ \w+B", label) for label in legend] == [[figure]]
    (line,) = gid_artists(memory.figure, "reserved")
    assert max(line.get_ydata()) * GIB == pytest.approx(plan.predicted.reserved_peak_bytes)
    gpu = dict(summary_lines(plan, report_budget(plan, profile)))["on the GPU"]
    assert re.findall(r"\d+\.\d+ \w+B", gpu.split("would hold at most ")[1])[0] == figure
    assert "retr" in memory.caption and "per step" in memory.caption


def _inside(fig):
    """Texts of each axes that stick out of it, in display coordinates (the renderer's extents)."""
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        box = ax.get_window_extent(renderer)
        out += [t.get_text() for t in ax.texts if not box.contains(*t.get_window_extent(renderer).p0)
                or not box.contains(*t.get_window_extent(renderer).p1)]
    return out


def test_tiny_plans_zoom_to_the_data_and_mark_the_budget(gpt2):
    """GPT-2's example peaks at about 1 GiB of a 40 GiB budget: the memory axes end near the data, and the
    budget is a legend entry pointing off scale instead of a line out of view."""
    from shard_planner.solve import PlanRequest, plan_model

    trace, profile, cm = gpt2
    plan = dataclasses.replace(_example_plan(trace, "examples/gpt2.py"), cluster=dataclasses.replace(
        _example_plan(trace, "examples/gpt2.py").cluster, mem_budget_bytes=40 * GIB))
    plan = _predicted(cm, plan)
    sections = build_sections(plan, trace=trace, profile=profile)
    memory = next(s for s in sections if s.image == "memory_timeline.png").figure
    top = memory.axes[0].get_ylim()[1]
    assert plan.predicted.peak_bytes / GIB < top < 2 * plan.predicted.reserved_peak_bytes / GIB
    assert not gid_artists(memory, "budget") and len(gid_artists(memory, "budget-off-scale")) == 1
    solved = plan_model(trace, PlanRequest(gpus=8, mem_budget_bytes=40 * GIB, profile=profile, micro_batch=2)).plan
    frontier = plot_frontier(solved, report_budget(solved, profile))
    lo, hi = frontier.axes[0].get_xlim()
    peaks = [q.peak_bytes / GIB for q in (*solved.frontier, *solved.baselines)]
    assert lo <= min(peaks) and max(peaks) <= hi < 2 * max(peaks) and hi < 40
    assert len(gid_artists(frontier, "budget-off-scale")) == 1 and not gid_artists(frontier, "budget")
    for fig in (memory, frontier):
        assert not texts_overlap(fig) and not _inside(fig)
    big = make_plan(8)  # 38 GiB of 40: the budget on scale, as before
    assert gid_artists(plot_frontier(big, report_budget(big)), "budget")


def test_timeline_writes_nothing_over_the_data():
    """The micro-steps' names stay in the band above the data and the lines, inside the axes; the peak is
    named in the legend with its event (no box over the reserved line)."""
    trace, plan = _stack_plan(8, LAST)
    from shard_planner.cost import CostModel

    profile = load_profile("h100-80gb")
    mem = CostModel(trace, profile).memory(plan)
    fig = plot_memory_timeline(mem, report_budget(plan, profile))
    ax = fig.axes[0]
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    data_top_px = ax.transData.transform((0, max(e.total_bytes for e in mem.timeline) / 2**30 * 1.001))[1]
    names = [t for t in ax.texts if t.get_text().strip()]
    assert [t.get_text().split("\n")[0] for t in names] == ["micro-step 1/8", "micro-steps 2..7 of 8",
                                                            "micro-step 8/8"]
    assert all(t.get_window_extent(renderer).y0 > data_top_px for t in names)
    assert not texts_overlap(fig) and not _inside(fig)
    legend = [t.get_text().replace("\n", " ") for t in fig.legends[0].get_texts()]
    assert any(label.startswith(f"peak {format_bytes(mem.peak_bytes)} allocated, at ") for label in legend)


def test_the_chosen_star_does_not_hide_a_policy():
    plan = make_plan(8, budget_gib=42)
    fig = plot_frontier(plan, report_budget(plan))
    (star,) = gid_artists(fig, "chosen")
    for b in plan.baselines:
        (marker,) = gid_artists(fig, f"baseline:{b.description}")
        assert marker.get_zorder() > star.get_zorder() and marker.get_sizes()[0] < star.get_sizes()[0]


def test_text_columns_are_left_aligned():
    plan = make_plan(8, budget_gib=42)
    html = to_html(frontier_table(plan, report_budget(plan)))
    assert '<td>chosen plan</td>' in html and re.search(r'<td class="num">[\d.,]+</td>', html)
    assert '<th>plan</th>' in html and '<th class="num">peak (GiB)</th>' in html


def test_the_summary_names_what_trains(gpt2):
    """A fine-tune is named in the summary, not only under the units table: the plan's (LoRA, QLoRA, frozen
    modules) or, for a model file that freezes its own, the count from the trace."""
    from shard_planner.plan.finetune import FineTune
    from shard_planner.trace.tracer import trace_model

    trace, _, _ = gpt2
    plan = make_plan(8)
    assert dict(summary_lines(plan, report_budget(plan), trace=trace))["trains"].startswith("every parameter (")
    assert "trains" not in dict(summary_lines(plan, report_budget(plan)))  # no trace, no fine-tune: not known
    lora = trace_model("examples/llama_lora.py")
    trains = dict(summary_lines(plan, report_budget(plan), trace=lora))["trains"]
    assert trains.startswith("fine-tune, the model file freezes the rest: ") and (
        f"{lora.trainable_param_count:,} of {lora.param_count:,} parameters train" in trains)
    qlora = dataclasses.replace(plan, model=dataclasses.replace(plan.model, finetune=FineTune(
        lora_rank=16, lora_targets=("q_proj", "v_proj"), qlora=True)))
    assert dict(summary_lines(qlora, report_budget(qlora)))["trains"] == (
        "fine-tune, QLoRA r=16 on q_proj, v_proj (NF4 base)")


def test_durations_never_in_exponent_form():
    assert [format_duration(s) for s in (10.74, 0.3341, 4.048e-5, 12_345.0, 1.5)] == [
        "10.74 s", "334.1 ms", "0.04048 ms", "12,345 s", "1.5 s"]
    slow = LayoutOutcome(ModelSplit(), "solved", 10.74, 10.0, 30 * GIB, 9.5, 1.2, 0.0, 64)
    (line,) = layout_lines(ModelSplit(), (slow,))
    assert "step 10.74 s: compute 9.5 s, exposed communication 1.2 s" in line and "e+" not in line


def test_exposed_communication_in_parts_that_add_up(gpt2, tmp_path, capsys):
    """Exposed communication counts FSDP2's copies and the compute slowed by overlapped collectives beside the
    wait for collectives (issue 36 item 8: 'communication 0.04048 ms of which exposed 0.04127 ms'): estimate,
    the units table and the units figure name the same parts (cost/types.py ExposedParts), and they add up."""
    from shard_planner.cli.main import main
    from shard_planner.plan import save_plan
    from shard_planner.report.plots import plot_units
    from shard_planner.report.rows import unit_rows
    from shard_planner.report.tables import units_table

    trace, profile, cm = gpt2
    plan = _example_plan(trace, "examples/gpt2.py")
    est = cm.estimate(plan)
    t = est.time
    parts = t.exposed_parts()
    assert parts.copies_s > 0 and parts.total_s == pytest.approx(t.exposed_comm_s)
    assert t.compute_s + t.exposed_comm_s + t.optimizer_s == pytest.approx(t.step_time_s)
    assert all(u.parts.total_s == pytest.approx(u.exposed_comm_s) for u in t.units)
    save_plan(plan, tmp_path / "plan.json")
    assert main(["estimate", "examples/gpt2.py", "--plan", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    step, exposed_line = [line for line in out.splitlines() if "exposed communication" in line][:2]
    ms = [float(v) * (1e-3 if u == "µs" else 1.0) for v, u in re.findall(r"([\d.]+) (ms|µs)", exposed_line)]
    total = float(re.search(r"exposed communication ([\d.]+) ms", step).group(1))
    assert "FSDP2's copies" in exposed_line and sum(ms) == pytest.approx(total, rel=2e-3)
    rows = unit_rows(plan, trace, est)
    table = units_table(rows)
    of_it = [c for c in table.columns if c.startswith("of it ")]
    assert "of it copies (ms)" in of_it
    assert (table[of_it].sum(axis=1) - table["exposed comm. (ms)"]).abs().max() < 1e-9
    fig = plot_units(rows)
    bars = [a for a in fig.findobj() if str(getattr(a, "get_gid", lambda: None)()).startswith("time:exposed:")]
    scale = 1e-3 if "(ms)" in fig.axes[1].get_xlabel() else 1.0
    for i, r in enumerate(rows):  # a row's stacked parts end at its exposed figure
        ends = [b.get_x() + b.get_width() for b in bars if abs(b.get_y() + b.get_height() / 2 - (i + 0.26)) < 1e-9]
        assert max(ends) * scale == pytest.approx(r.exposed_comm_s)


def test_the_caption_says_the_budget_is_off_scale(gpt2):
    trace, profile, cm = gpt2
    plan = _predicted(cm, _example_plan(trace, "examples/gpt2.py"))  # about 1 GiB of 8 GiB
    memory = next(s for s in build_sections(plan, trace=trace, profile=profile) if s.image == "memory_timeline.png")
    assert "is off this plot's scale" in memory.caption and "The dashed line is --mem" not in memory.caption


def test_a_cpu_plan_reads_in_cpu_ranks_and_round_mib(tmp_path):
    """A tiny plan on cpu-gloo: the report said "2 GPUs" and "per GPU" (issue 36 item 12), its frontier axis read
    4.096, 4.608, ... MiB (ticks placed at round GiB values) and its table gave the peak as 0.00737 GiB."""
    from shard_planner.solve import PlanRequest, plan_model
    from shard_planner.trace.tracer import trace_model

    trace = trace_model("examples/llama.py")
    profile = load_profile("cpu-gloo")
    plan = plan_model(trace, PlanRequest(gpus=2, mem_budget_bytes=2 * GIB, profile=profile, micro_batch=8)).plan
    budget = report_budget(plan, profile)
    summary = dict(summary_lines(plan, budget))
    assert summary["cluster"].startswith("2 CPU ranks,") and "per CPU rank" in summary["predicted peak"]
    assert not any("GPU" in v for k, v in summary.items() if k != "model")
    frontier = plot_frontier(plan, budget)
    ax = frontier.axes[0]
    assert "per CPU rank (MiB)" in ax.get_xlabel() and "on 2 CPU ranks" in ax.get_title()
    FigureCanvasAgg(frontier).draw()
    lo, hi = ax.get_xlim()
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text() and lo <= t.get_position()[0] <= hi]
    assert len(ticks) >= 3 and all(re.fullmatch(r"\d+(\.(25|5|75|0*[1-9]|[1-9]))?", t) for t in ticks), ticks
    table = frontier_table(plan, budget)
    assert "peak (MiB)" in table.columns and table["peak (MiB)"].max() > 1
    from shard_planner.report import write_report

    html = write_report(plan, tmp_path / "rep", trace=trace, profile=profile).read_text()
    assert "on 2 CPU ranks</h1>" in html and "per GPU" not in html
