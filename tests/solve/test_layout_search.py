"""Tier 1: the layout (the split of the model over ranks: its tensor-parallel degree) searched as the outermost
global choice (solve/layout_search.py), on
hand-written one-rank traces (tests/models/cost_synth.py ``tp_rank``): the answer is the fastest degree's plan,
every degree's outcome (figures and frontier) is in the plan, a degree the global
batch does not divide is an outcome with its reason, a degree screened far behind is not searched, and the
reason line carries each degree's figures."""

import pytest

from shard_planner.errors import UserError
from shard_planner.plan import Plan
from shard_planner.parallel.mesh import ModelSplit
from shard_planner.plan.points import LayoutOutcome
from shard_planner.hardware.profile import load_profile
from shard_planner.solve import PlanRequest, layout_search, plan_model
from shard_planner.plan.points import layout_reason
from shard_planner.solve.layout_search import LayoutOption, plan_over_layouts
from shard_planner.parallel.tensor_parallel import TensorParallel
from tests.models.cost_synth import synthetic_trace

STYLES = TensorParallel(styles={"embed": "embedding", "head": "head"}, sequence_parallel=False, loss_parallel=False)
LAYERS, H, S, V = 4, 1024, 512, 4096


def options(*degrees):
    return [LayoutOption(ModelSplit(tp=t), synthetic_trace(LAYERS, H, S, V, tp=t), None if t == 1 else STYLES)
            for t in degrees]


@pytest.fixture(scope="module")
def request_8():
    return PlanRequest(gpus=8, mem_budget_bytes=8 * 2**30, profile=load_profile("h100-80gb"), micro_batch=2,
                       time_limit_s=2.0, frontier_points=2, allocator_check=False)


def test_the_fastest_degree_wins_and_every_degree_is_an_outcome(request_8, monkeypatch):
    monkeypatch.setattr(layout_search, "SCREEN_MARGIN", 1.0)  # search both in full
    result = plan_over_layouts(options(1, 2), request_8)
    outcomes = result.plan.layouts
    assert [o.split.tp for o in outcomes] == [1, 2] and all(o.judged == "solved" for o in outcomes)
    fastest = max(outcomes, key=lambda o: o.samples_per_s)
    assert result.plan.mesh.tp == fastest.split.tp and result.plan.predicted.step_time_s == fastest.step_time_s
    other = next(o for o in outcomes if o is not fastest)
    assert not any("TP" in b.description for b in result.plan.baselines)  # the degrees are outcomes, not policies
    assert (result.plan.tensor_parallel is not None) == (result.plan.mesh.tp > 1)
    # each degree's search is plan_model on its own trace: the same plan as searching that degree alone
    alone = plan_model(synthetic_trace(LAYERS, H, S, V, tp=2), request_8.__class__(
        **{**request_8.__dict__, "tensor_parallel": STYLES}))
    two = next(o for o in outcomes if o.split.tp == 2)
    assert two.step_time_s == pytest.approx(alone.plan.predicted.step_time_s)
    assert two.frontier == alone.plan.frontier and two.samples_per_step == alone.plan.global_batch_samples
    assert outcomes[1].split_comm_s > 0 and outcomes[0].split_comm_s == 0
    line = layout_reason(result.plan.mesh.split, outcomes)
    assert line.startswith(f"{fastest.label} chosen ({fastest.fastest_plan}; step ") and f"{other.label}: -" in line
    assert "samples/s" in line and "micro-batch 2" in fastest.fastest_plan
    # the outcomes travel in the plan file, and a plan file written before the layout search reads the same
    d = result.plan.to_dict()
    assert Plan.from_dict(d).layouts == outcomes and all("pp" not in o["split"] for o in d["layouts"])
    renamed = {"split": "degree", "split_comm_s": "tp_comm_s", "fastest_plan": "layout"}
    old = {k: v for k, v in d.items() if k != "layouts"}
    old["tp_degrees"] = [{renamed.get(k, k): (v["tp"] if k == "split" else v) for k, v in o.items()}
                         for o in d["layouts"]]
    assert Plan.from_dict(old).layouts == outcomes


def test_a_split_checks_its_trace_and_is_refused_with_pipeline_stages():
    with pytest.raises(ValueError, match="a trace at TP 1 given for TP 2"):
        LayoutOption(ModelSplit(tp=2), synthetic_trace(LAYERS, H, S, V, tp=1), STYLES)
    from shard_planner.errors import PlanError
    with pytest.raises(PlanError, match="pipeline stages are not planned yet"):
        ModelSplit(tp=2, pp=2)
    assert [s.key for s in sorted([ModelSplit(tp=4), ModelSplit(), ModelSplit(tp=2)])] == ["tp1", "tp2", "tp4"]
    assert ModelSplit(tp=8).label == "TP 8" and ModelSplit().label == "no tensor parallelism"


def test_a_degree_screened_far_behind_keeps_its_screened_figures(request_8, monkeypatch):
    monkeypatch.setattr(layout_search, "SCREEN_MARGIN", 0.0)  # only the best screened degree is searched
    searched = []
    real = layout_search.plan_model
    monkeypatch.setattr(layout_search, "plan_model", lambda trace, req: searched.append(trace.tp_size) or real(trace, req))
    result = plan_over_layouts(options(1, 2), request_8)
    judged = {o.split.tp: o.judged for o in result.plan.layouts}
    assert sorted(judged.values()) == ["screened", "solved"] and searched == [result.plan.mesh.tp]
    loser = next(o for o in result.plan.layouts if o.judged == "screened")
    assert loser.step_time_s > 0 and loser.frontier == () and "screened only" in layout_reason(
        result.plan.mesh.split, result.plan.layouts)


def test_the_others_run_beside(request_8, monkeypatch):
    monkeypatch.setattr(layout_search, "SCREEN_MARGIN", 1.0)
    started = []

    events = []
    real = layout_search.plan_model
    monkeypatch.setattr(layout_search, "plan_model", lambda trace, req: events.append("own search") or real(trace, req))

    class Later:  # a search beside: started at once, run when its result is asked for
        def __init__(self, fn, *args):
            started.append(args[0].tp_size)
            self.run = lambda: fn(*args)

        def result(self):
            events.append("wait beside")
            return self.run()

    result = plan_over_layouts(options(1, 2), request_8, beside=Later, while_waiting=lambda: events.append("idle"))
    assert len(started) == 1 and {o.judged for o in result.plan.layouts} == {"solved"}
    assert events[:3] == ["own search", "idle", "wait beside"]


def test_a_degree_the_global_batch_does_not_divide_is_an_outcome(request_8):
    req = request_8.__class__(**{**request_8.__dict__, "global_batch_samples": 4, "micro_batch": None})
    result = plan_over_layouts(options(1, 2), req)  # 8 data-parallel ranks cannot share 4 samples
    outcomes = result.plan.layouts
    assert result.plan.mesh.tp == 2 and result.plan.global_batch_samples == 4
    assert outcomes[0].judged == "refused" and "--global-batch 4 is not a multiple of 8" in outcomes[0].refused
    assert "no tensor parallelism: --global-batch 4" in layout_reason(ModelSplit(tp=2), outcomes)
    with pytest.raises(UserError, match="--global-batch 4 is not a multiple of 8"):
        plan_over_layouts(options(1), req)  # one degree: its own error


def test_degrees_refused_before_tracing_are_outcomes(request_8):
    refused = (LayoutOutcome(ModelSplit(tp=4), judged="refused", refused="the heads 2 do not divide by 4"),)
    result = plan_over_layouts(options(1), request_8, refused=refused)
    assert [o.split.tp for o in result.plan.layouts] == [1, 4] and "TP 4: the heads" in layout_reason(
        ModelSplit(), result.plan.layouts)
    with pytest.raises(UserError, match="TP 4: the heads 2 do not divide by 4"):
        plan_over_layouts([], request_8, refused=refused)


def test_a_degree_is_never_slower_than_its_screen(request_8, monkeypatch):
    """The full search starts from the degree's screened plan (PlanRequest.start_plans): with a search that
    finds only a slower plan (full activation checkpointing) and no recipes, the answer is still the screen's. On
    Llama 3 70B, 64 H100s, 80GB, TP 2's search answered 1.9% slower than its own screen before."""
    from dataclasses import replace

    from shard_planner.plan.recipes import recipe_named
    from shard_planner.solve import alternatives, planner

    trace = synthetic_trace(LAYERS, H, S, V, tp=1)
    screened = planner.screen_degree(trace, request_8)
    full_ac = recipe_named("full-ac")
    monkeypatch.setattr(planner, "_search", lambda ctx: [ctx.check_units(
        full_ac.units(ctx.space(screened.choice.mesh)), screened.choice, full_ac.title)])
    for name in ("recipes", "no_wrapping", "root_resharded"):  # nothing else the pool holds
        monkeypatch.setattr(alternatives, name, lambda ctx, *_: [])
    monkeypatch.setattr(planner, "sweep", lambda ctx, best, points: [])
    monkeypatch.setattr(planner, "_polished", lambda ctx, chosen, status: (chosen, status))
    weak = plan_model(trace, request_8).plan.predicted.samples_per_s
    assert weak < screened.samples_per_s * (1 - 1e-3)  # the weakened search alone loses to the screen
    started = plan_model(trace, replace(request_8, start_plans=(screened.plan,))).plan
    assert started.predicted.samples_per_s >= screened.samples_per_s * (1 - 1e-9)
    assert started.units == screened.plan.units and "screened plan" in started.solver.status
