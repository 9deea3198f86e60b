"""The CUDA caching allocator in the report (shard_planner/report/reserved.py): on a GPU profile the memory
timeline draws the simulated reserved bytes beside the allocated stack, and the summary the plan's allocator
figures."""

import dataclasses

import pytest

from tests.models.report_fixtures import GIB
from tests.report.test_report import _example_plan, gid_artists
from shard_planner.plan import Plan
from shard_planner.report import build_sections
from shard_planner.report.budget import report_budget
from shard_planner.units import format_bytes


@pytest.fixture(scope="module")
def gpt2_trace():
    from shard_planner.trace.tracer import trace_model

    return trace_model("examples/gpt2.py")


def test_gpu_timeline_draws_the_simulated_reserved_memory(gpt2_trace):
    """On a GPU profile the memory timeline draws the caching allocator's reserved bytes over the allocated
    stack, one step per event, outside bytes added (report/reserved.py); the summary gives the plan file's
    allocator figures; on a CPU profile neither."""
    from shard_planner.cost import CostModel
    from shard_planner.cost.fits import device_fit
    from shard_planner.hardware.profile import load_profile
    from shard_planner.report.render import summary_lines

    trace = gpt2_trace
    profile = load_profile("h100-80gb")
    cm = CostModel(trace, profile)
    plan = _example_plan(trace, "examples/gpt2.py")
    fit = device_fit(cm, plan)
    plan = Plan(**{**plan.__dict__, "predicted": dataclasses.replace(cm.estimate(plan).prediction(), **fit.prediction_fields())})
    sections = build_sections(plan, trace=trace, profile=profile)
    memory = next(s for s in sections if s.image == "memory_timeline.png")
    (line,) = gid_artists(memory.figure, "reserved")
    events = cm.estimate(plan).memory.timeline
    assert len(line.get_ydata()) == 2 * len(events)  # a step per event
    expected = cm.reserved_timeline(plan, True, None)  # with no memory limit: the plan's reserved figure
    assert line.get_ydata()[0] == pytest.approx((expected.marks[0][4] + expected.outside_bytes) / GIB)
    assert max(line.get_ydata()) * GIB == pytest.approx(fit.reserved_peak_total_bytes)
    assert "The black line is the memory the CUDA caching allocator holds (reserved)" in memory.caption
    labels = [t.get_text() for t in memory.figure.legends[0].get_texts()]
    reserved = f"peak {format_bytes(fit.reserved_peak_total_bytes)}"
    assert any(label.startswith("reserved (CUDA caching allocator, simulated,") and label.endswith(reserved)
               for label in labels)
    summary = dict(summary_lines(plan, report_budget(plan, profile)))
    assert f"it would hold at most {format_bytes(fit.reserved_peak_total_bytes)} (reserved peak" in summary["on the GPU"]
    cpu = load_profile("cpu-gloo")
    cpu_plan = Plan(**{**plan.__dict__, "predicted": CostModel(trace, cpu).estimate(plan).prediction()})
    cpu_memory = next(s for s in build_sections(cpu_plan, trace=trace, profile=cpu) if s.image == "memory_timeline.png")
    assert not gid_artists(cpu_memory.figure, "reserved") and "on the GPU" not in dict(
        summary_lines(cpu_plan, report_budget(cpu_plan, cpu)))
