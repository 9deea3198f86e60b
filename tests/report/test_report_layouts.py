"""The report's layouts, each a tensor-parallel degree (issue 30: the frontier with and without TP, with the
reasons; issue 37: keyed by the split, ``ModelSplit``): a "Layouts" section only for a plan that searched more
than one, its figure one Pareto
frontier per solved degree in that degree's own throughput, its table a row per degree, the reason line
in the summary; a plan of one degree renders exactly as before the degree search.

``data/report_one_degree.md`` is report.md of ``make_plan(8, budget_gib=42)`` (the plan file alone) as
rendered at cdb4ed5, before the report knew about degrees, the version replaced by
``<version>``. A deliberate change to the report's text regenerates it (see
:func:`test_a_plan_of_one_degree_renders_as_before`)."""

from dataclasses import replace
from pathlib import Path

import pytest

from shard_planner import __version__
from shard_planner.plan import Mesh, ModelRef, Plan
from shard_planner.parallel.mesh import ModelSplit
from shard_planner.plan.points import FrontierPoint, LayoutOutcome, layout_reason
from shard_planner.hardware.profile import load_profile
from shard_planner.report import build_sections, write_report
from shard_planner.report.budget import report_budget
from shard_planner.report.layouts import layouts_table, plot_layouts
from shard_planner.report.plots import plot_frontier
from shard_planner.report.render import summary_lines
from shard_planner.report.tables import to_markdown
from shard_planner.solve import PlanRequest, layout_search
from shard_planner.solve.layout_search import LayoutOption, plan_over_layouts
from shard_planner.parallel.tensor_parallel import TensorParallel
from tests.models.cost_synth import synthetic_trace
from tests.models.report_fixtures import GIB, make_plan
from tests.report.test_report import gid_artists, texts_overlap

DATA = Path(__file__).parent / "data"
STYLES = TensorParallel(styles={"embed": "embedding", "head": "head"}, sequence_parallel=False, loss_parallel=False)

pytestmark = pytest.mark.usefixtures("in_repository_root")


def one_degree_markdown(tmp_path) -> str:
    plan = make_plan(8, budget_gib=42)
    write_report(plan, tmp_path)
    return (tmp_path / "report.md").read_text().replace(__version__, "<version>")


def test_a_plan_of_one_degree_renders_as_before(tmp_path):
    # To regenerate after a deliberate change: write one_degree_markdown(tmp_path) to DATA / "report_one_degree.md".
    assert one_degree_markdown(tmp_path) == (DATA / "report_one_degree.md").read_text()


# ---- a plan that searched four degrees, by hand ----

def four_degrees(plan: Plan) -> tuple[LayoutOutcome, ...]:
    """``plan``'s own degree solved (its figures and frontier), the others: TP 2 solved with a frontier of
    two plans at half the global batch, TP 4 screened at a quarter, TP 8 refused."""
    p, tp = plan.predicted, plan.mesh.tp
    own = LayoutOutcome(ModelSplit(tp=tp), "solved", p.step_time_s, p.samples_per_s, p.peak_bytes, 1.0, 0.08, 0.0 if tp == 1 else 0.1,
                        plan.global_batch_samples, plan.frontier)
    others = {
        1: LayoutOutcome(ModelSplit(), "solved", 1.4, 64 / 1.4, 30 * GIB, 1.1, 0.2, 0.0, 64,
                         (FrontierPoint(30 * GIB, 1.4, "tp1 a"), FrontierPoint(35 * GIB, 1.3, "tp1 b"))),
        2: LayoutOutcome(ModelSplit(tp=2), "solved", 0.9, 32 / 0.9, 20 * GIB, 0.7, 0.05, 0.12, 32,
                         (FrontierPoint(12 * GIB, 1.0, "tp2 a"), FrontierPoint(20 * GIB, 0.9, "tp2 b"))),
        4: LayoutOutcome(ModelSplit(tp=4), "screened", 0.8, 16 / 0.8, 10 * GIB, 0.5, 0.1, 0.2, 16),
        8: LayoutOutcome(ModelSplit(tp=8), "refused", refused="the global batch of 64 samples does not divide over 1 rank"),
    }
    return tuple(own if d == tp else others[d] for d in (1, 2, 4, 8))


def tp_plan(tp: int = 1) -> Plan:
    """make_plan(8)'s plan at ``tp`` (FSDP over 8 / tp GPUs x TP tp), with :func:`four_degrees`."""
    plan = make_plan(8, budget_gib=42)
    if tp > 1:
        plan = replace(plan, mesh=Mesh(shard=8 // tp, tp=tp), tensor_parallel=STYLES)
    return replace(plan, layouts=four_degrees(plan))


def frontier_xy(fig, gid) -> list[tuple[float, float]]:
    (line,) = gid_artists(fig, gid)
    return list(zip(line.get_xdata(), line.get_ydata()))


def test_the_section_only_for_a_plan_of_several_degrees():
    titles = [s.title for s in build_sections(tp_plan())]
    assert titles[:2] == ["Memory vs throughput", "Layouts"]
    assert "Layouts" not in [s.title for s in build_sections(make_plan(8, budget_gib=42))]
    (section,) = [s for s in build_sections(tp_plan()) if s.title == "Layouts"]
    assert section.image == "layouts.png" and section.figure is not None
    for cited in ("no tensor parallelism (solved), TP 2 (solved), TP 4 (screened), TP 8 (refused)",
                  "no tensor parallelism chosen", "[Note: Screening the layouts]",
                  "[Note: Why a layout wins or loses]", "layouts line"):
        assert cited in section.caption


def test_one_frontier_per_solved_degree_in_its_own_throughput():
    plan = tp_plan()
    fig = plot_layouts(plan, report_budget(plan))
    assert plot_layouts(make_plan(8), report_budget(make_plan(8))) is None
    lines = {a.get_gid() for a in fig.findobj() if str(a.get_gid()).startswith("frontier:")}
    assert lines == {"frontier:tp1", "frontier:tp2"}  # solved only; TP 4 screened, TP 8 refused
    # TP 2's points do 32 samples x 1024 tokens per step, not the chosen plan's 64 x 1024
    expected = [(12.0, 32 * 1024 / 1.0), (20.0, 32 * 1024 / 0.9)]
    assert frontier_xy(fig, "frontier:tp2") == [pytest.approx(xy) for xy in expected]
    assert len(frontier_xy(fig, "frontier:tp1")) == len(plan.frontier)
    (screened,) = gid_artists(fig, "screened:tp4")
    assert tuple(screened.get_offsets()[0]) == pytest.approx((10.0, 16 * 1024 / 0.8))
    assert tuple(screened.get_facecolors()[0]) == (1.0, 1.0, 1.0, 1.0)  # hollow
    assert not gid_artists(fig, "screened:tp8") and not gid_artists(fig, "frontier:tp8")
    (chosen,) = gid_artists(fig, "chosen")
    p = plan.predicted
    assert tuple(chosen.get_offsets()[0]) == pytest.approx((p.peak_bytes / GIB, 64 * 1024 / p.step_time_s))
    assert len(gid_artists(fig, "budget")) == len(gid_artists(fig, "usable-budget")) == 1
    assert "(tokens/s" in fig.axes[0].get_ylabel() and not texts_overlap(fig)


def test_samples_per_second_without_a_sequence_length():
    plan = replace(tp_plan(), model=ModelRef("examples/vit.py", "f" * 16))
    fig = plot_layouts(plan, report_budget(plan))
    assert "(samples/s" in fig.axes[0].get_ylabel()
    assert frontier_xy(fig, "frontier:tp2") == [pytest.approx(xy) for xy in [(12.0, 32 / 1.0), (20.0, 32 / 0.9)]]
    assert "throughput (samples/s)" in layouts_table(plan).columns


def test_a_row_per_degree():
    plan = tp_plan()
    df = layouts_table(plan)
    assert list(df["layout"]) == ["no tensor parallelism (chosen)", "TP 2", "TP 4", "TP 8"]
    assert list(df["judged"]) == ["solved", "solved", "screened", "refused"]
    assert df["throughput (tokens/s)"][1] == pytest.approx(32 * 1024 / 0.9)
    assert df["of it TP collectives (s)"][2] == 0.2 and df["why refused"][3].startswith("the global batch of 64")
    md = to_markdown(df)
    assert "| TP 2 | solved | 32 | 0.900 | 36,409 | 20.0 | 0.700 | 0.050 | 0.120 |  |" in md
    assert "| TP 8 | refused |  |  |  |  |  |  |  | the global batch of 64 samples does not divide over 1 rank |" in md


def test_the_summary_says_why(tmp_path):
    plan = tp_plan()
    summary = dict(summary_lines(plan, report_budget(plan)))
    assert summary["layouts"] == layout_reason(ModelSplit(), plan.layouts)
    assert summary["layouts"].startswith("no tensor parallelism chosen (step ")
    assert "layouts" not in dict(summary_lines(make_plan(8), report_budget(make_plan(8))))
    write_report(plan, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| layouts | no tensor parallelism chosen" in md and "## Layouts" in md
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["frontier.png", "layouts.png", "memory_at_peak.png"]


def test_a_tensor_parallel_plan_names_its_mesh():
    plan = tp_plan(2)
    fig = plot_frontier(plan, report_budget(plan))
    assert fig.axes[0].get_title().endswith("on 8 GPUs, micro-batch 8\nFSDP over 4 GPUs x TP 2")
    assert not texts_overlap(fig)
    one = make_plan(8, budget_gib=42)
    assert plot_frontier(one, report_budget(one)).axes[0].get_title().endswith("on 8 GPUs, micro-batch 8")
    summary = dict(summary_lines(plan, report_budget(plan)))
    assert summary["mesh"] == "4-way sharding x TP 2 (tensor parallelism)"
    assert summary["layouts"].startswith("TP 2 chosen (step ")
    assert "TP 2 (chosen)" in list(layouts_table(plan)["layout"])


# ---- degrees the planner searched ----

def test_the_planners_degrees_in_the_report(tmp_path, monkeypatch):
    """plan_over_layouts on one-rank synthetic traces at TP 1 and 2, both searched in full: each degree's
    frontier drawn at its own global batch, the table and the summary from the plan's outcomes."""
    monkeypatch.setattr(layout_search, "SCREEN_MARGIN", 1.0)
    request = PlanRequest(gpus=8, mem_budget_bytes=8 * GIB, profile=load_profile("h100-80gb"), micro_batch=2,
                          time_limit_s=2.0, frontier_points=2, allocator_check=False)
    options = [LayoutOption(ModelSplit(tp=t), synthetic_trace(4, 1024, 512, 4096, tp=t), None if t == 1 else STYLES)
               for t in (1, 2)]
    plan = plan_over_layouts(options, request).plan
    assert [o.judged for o in plan.layouts] == ["solved", "solved"] and plan.model.seq_len == 512
    fig = plot_layouts(plan, report_budget(plan))
    for o in plan.layouts:
        first = min(o.frontier, key=lambda q: (q.peak_bytes, q.step_time_s))
        assert frontier_xy(fig, f"frontier:{o.split.key}")[0] == pytest.approx(
            (first.peak_bytes / GIB, o.samples_per_step * 512 / first.step_time_s))
    assert {o.samples_per_step for o in plan.layouts} == {16, 8}  # micro-batch 2 x 8 / tp ranks
    write_report(plan, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert f"| layouts | {layout_reason(plan.mesh.split, plan.layouts)} |" in md.replace("\\|", "|")
    assert md.count("| solved |") == 2
