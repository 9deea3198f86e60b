"""Tier 1: the tensor-parallel degree searched as the outermost global choice (solve/tp_search.py), on
hand-written one-rank traces (tests/models/cost_synth.py ``tp_rank``): the answer is the fastest degree's plan,
the others' fastest plans are its baselines, a degree the global batch does not divide is an outcome with
its reason, and the reason line carries each degree's figures."""

import pytest

from shard_planner.errors import UserError
from shard_planner.profile import load_profile
from shard_planner.solve import PlanRequest, plan_model
from shard_planner.solve.tp_search import DegreeOption, degree_reason, plan_over_degrees
from shard_planner.tensor_parallel import TensorParallel
from tests.models.cost_synth import synthetic_trace

STYLES = TensorParallel(styles={"embed": "embedding", "head": "head"}, sequence_parallel=False, loss_parallel=False)
LAYERS, H, S, V = 4, 1024, 512, 4096


def options(*degrees):
    return [DegreeOption(None if t == 1 else STYLES, synthetic_trace(LAYERS, H, S, V, tp=t)) for t in degrees]


@pytest.fixture(scope="module")
def request_8():
    return PlanRequest(gpus=8, mem_budget_bytes=8 * 2**30, profile=load_profile("h100-80gb"), micro_batch=2,
                       time_limit_s=2.0, frontier_points=2, allocator_check=False)


def test_the_fastest_degree_wins_and_the_others_are_baselines(request_8):
    result, outcomes = plan_over_degrees(options(1, 2), request_8)
    assert [o.degree for o in outcomes] == [1, 2] and all(o.refused is None for o in outcomes)
    fastest = max(outcomes, key=lambda o: o.samples_per_s)
    assert result.plan.mesh.tp == fastest.degree and result.estimate.time.step_time_s == fastest.step_time_s
    other = next(o for o in outcomes if o is not fastest)
    assert any(b.description == f"fastest at {other.label}" and b.step_time_s == pytest.approx(other.step_time_s)
               for b in result.plan.baselines)
    assert (result.plan.tensor_parallel is not None) == (result.plan.mesh.tp > 1)
    # each degree's search is plan_model on its own trace: the same plan as searching that degree alone
    alone = plan_model(synthetic_trace(LAYERS, H, S, V, tp=2), request_8.__class__(
        **{**request_8.__dict__, "tensor_parallel": STYLES}))
    assert next(o for o in outcomes if o.degree == 2).step_time_s == pytest.approx(alone.estimate.time.step_time_s)
    assert outcomes[1].tp_comm_s > 0 and outcomes[0].tp_comm_s == 0
    line = degree_reason(fastest, outcomes)
    assert line.startswith(f"{fastest.label} chosen (step ") and f"{other.label} -" in line and "samples/s" in line


def test_a_degree_the_global_batch_does_not_divide_is_an_outcome(request_8):
    req = request_8.__class__(**{**request_8.__dict__, "global_batch_samples": 4, "micro_batch": None})
    result, outcomes = plan_over_degrees(options(1, 2), req)  # 8 data-parallel ranks cannot share 4 samples
    assert result.plan.mesh.tp == 2 and result.plan.global_batch_samples == 4
    assert outcomes[0].refused is not None and "--global-batch 4 is not a multiple of 8" in outcomes[0].refused
    assert "no tensor parallelism: --global-batch 4" in degree_reason(outcomes[1], outcomes)
    with pytest.raises(UserError, match="--global-batch 4 is not a multiple of 8"):
        plan_over_degrees(options(1), req)  # one degree: its own error
