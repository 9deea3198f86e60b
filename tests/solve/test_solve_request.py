"""The planner's typed request and result, its one memoised call to the cost model, and its
preference for simpler plans (issue 11, items 3 and 8), on hand-written traces (tests/models/solve_traces.py).

- PlanRequest validates at construction (UserError), and is frozen;
- PlanResult: the estimate is the cost model's for the returned plan (timeline included), the stages
  add up, and no plan is simulated twice in one call;
- simpler plans: among plans within 1% of the fastest the one with fewest unit shapes; past 1% the
  fastest; checkpointing a one-off module counts as a shape; end to end, the planner's plan is within
  ``simpler_within`` of the fastest it found and no more complex than its fastest plan.
"""

from dataclasses import FrozenInstanceError, replace

import pytest

import shard_planner.cost as cost
from shard_planner.cost.model import CostModel
from tests.models.solve_traces import GIB, profile, stack_trace
from shard_planner.errors import UserError
from shard_planner.plan import ROOT, Unit
from shard_planner.solve import PlanRequest, plan_model
from shard_planner.solve.simpler import complexity, simplest_within

PROFILE = profile()


def _request(**kw) -> PlanRequest:
    base = dict(gpus=8, mem_budget_bytes=2 * GIB, profile=PROFILE, gpus_per_node=8, micro_batch=4, frontier_points=3,
                time_limit_s=2.0)
    return PlanRequest(**{**base, **kw})


@pytest.mark.parametrize("bad", [dict(gpus=0), dict(gpus_per_node=0), dict(micro_batch=0), dict(mem_budget_bytes=0),
                                 dict(time_limit_s=0.0), dict(optimizer="lion"), dict(param_dtype="bf16"),
                                 dict(frontier_points=0), dict(simpler_within=1.5)])
def test_request_validated_at_construction(bad):
    with pytest.raises(UserError):
        _request(**bad)


def test_request_frozen():
    with pytest.raises(FrozenInstanceError):
        _request().gpus = 4


def test_result_carries_the_plans_estimate_and_each_plan_is_simulated_once(monkeypatch):
    calls = []
    real = CostModel.estimate

    def counting(self, plan, *, timeline=True):
        calls.append((plan.units, plan.prefetch, plan.mesh, plan.training, timeline))
        return real(self, plan, timeline=timeline)

    monkeypatch.setattr(CostModel, "estimate", counting)
    trace = stack_trace(6)
    result = plan_model(trace, _request())
    assert len(calls) == len(set(calls)) == result.timings.simulated_plans  # the memo: no plan twice
    monkeypatch.setattr(CostModel, "estimate", real)
    again = cost.estimate(trace, replace(result.plan, predicted=None, solver=None, frontier=(), baselines=()),
                          PROFILE)
    assert result.estimate.memory.peak_bytes == again.memory.peak_bytes == result.plan.predicted.peak_bytes
    assert result.estimate.time.step_time_s == pytest.approx(again.time.step_time_s)
    assert result.estimate.memory.timeline  # the report draws it without running the cost model again
    t = result.timings
    stages = t.screen_s + t.solve_s + t.frontier_s + t.baselines_s + t.polish_s + t.simplify_s + t.other_s
    assert stages == pytest.approx(t.total_s, rel=1e-6) and t.cpsat_solves >= 1
    assert 0 < t.cpsat_s <= t.total_s and 0 < t.simulate_s <= t.total_s
    assert result.frontier == result.plan.frontier and result.baselines == result.plan.baselines


# ---- simpler plans (solve/simpler.py) ----

MIXED = (Unit((ROOT,), False), Unit(("layers.0",), True, True), Unit(("layers.1", "layers.2"), True),
         Unit(("layers.3",), False))
UNIFORM = (Unit((ROOT,), False), Unit(("layers.0", "layers.1"), True, True), Unit(("layers.2", "layers.3"), True, True))


def test_complexity_counts_shapes_and_checkpointed_one_offs():
    assert complexity(UNIFORM) == 1 and complexity(MIXED) == 3
    one_off = frozenset({"embed", "norm"})
    plain = UNIFORM + (Unit(("embed",), True),)
    assert complexity(plain, one_off) == 2
    assert complexity(UNIFORM + (Unit(("embed",), True, True),), one_off) == 3  # checkpointing an embedding costs one


@pytest.mark.parametrize("uniform_s,expected", [(1.009, UNIFORM), (1.011, MIXED), (0.999, UNIFORM)])
def test_simplest_within_one_percent(uniform_s, expected):
    options = [(MIXED, 1.0), (UNIFORM, uniform_s)]
    chosen = simplest_within(options, step_time_s=lambda o: o[1], units=lambda o: o[0])
    assert chosen[0] == expected


def test_simplest_within_prefers_the_faster_among_equally_simple():
    options = [(UNIFORM, 1.004), (MIXED, 1.0), (UNIFORM[:2] + (Unit(("layers.2", "layers.3"), True, True),), 1.002)]
    assert simplest_within(options, step_time_s=lambda o: o[1], units=lambda o: o[0])[1] == 1.002


def test_planner_prefers_a_simpler_plan_within_its_tolerance(monkeypatch):
    import shard_planner.solve.planner as planner

    monkeypatch.setattr(planner, "POLISH_MAX_S", 100.0)  # only the evaluation budget: the same search both times
    trace = stack_trace(8)
    for budget in (GIB, 2 * GIB):  # one search each (no allocator check: it may search again, at another budget)
        fastest = plan_model(trace, _request(mem_budget_bytes=budget, simpler_within=0.0, allocator_check=False))
        simple = plan_model(trace, _request(mem_budget_bytes=budget, allocator_check=False))
        assert fastest.plan.predicted.step_time_s == pytest.approx(fastest.fastest_step_time_s)
        assert simple.plan.predicted.step_time_s <= simple.fastest_step_time_s * 1.01 * (1 + 1e-9)
        assert simple.fastest_step_time_s == pytest.approx(fastest.fastest_step_time_s)
        assert complexity(simple.plan.units) <= complexity(fastest.plan.units)
        assert simple.plan.predicted.peak_bytes <= PROFILE.tensor_budget_bytes(budget)
