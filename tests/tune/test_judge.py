"""Tier 1: ``tune`` judges a candidate as the planner does (shard_planner/tune/judge.py): on a GPU profile its
simulated allocator must survive --mem and its step time includes the retries it needs; on a CPU profile
the allocated peak alone decides and nothing is added."""

from dataclasses import replace

import pytest

from shard_planner.cost import CostModel, estimate
from shard_planner.cost.fits import device_fit
from shard_planner.hardware.profile import load_profile
from shard_planner.tune.candidates import _neighbours, top_candidates
from shard_planner.tune.judge import Judge
from tests.cost.test_cost_model import synth_plan
from tests.models import cost_synth

MIB = 2**20
H200 = load_profile("h200")


@pytest.fixture(scope="module")
def trace_and_plan():
    trace = cost_synth.synthetic_trace(layers=8)
    return trace, synth_plan(trace, 8, mb=1)


def _at(plan, mem_bytes):
    return replace(plan, cluster=replace(plan.cluster, mem_budget_bytes=mem_bytes))


def test_a_peak_within_the_budget_that_runs_out_of_memory_does_not_fit(trace_and_plan):
    """At the --mem whose search budget just holds the allocated peak, the simulated allocator runs out of
    memory: the allocated peak alone would have accepted it."""
    trace, plan = trace_and_plan
    mem = H200.mem_for_tensor_budget(estimate(trace, plan, H200).memory.peak_bytes)
    p = _at(plan, mem)
    prediction, fits = Judge(trace, estimate).judged(p, H200, H200.tensor_budget_bytes(mem))
    assert prediction.peak_bytes <= H200.tensor_budget_bytes(mem)
    assert not device_fit(CostModel(trace, H200), p).survives and not fits


def test_a_plan_that_retries_fits_with_its_retries_priced(trace_and_plan):
    trace, plan = trace_and_plan
    mem = H200.mem_for_tensor_budget(estimate(trace, plan, H200).memory.peak_bytes) + 1000 * MIB
    p = _at(plan, mem)
    judge = Judge(trace, estimate)
    prediction, fits = judge.judged(p, H200, H200.tensor_budget_bytes(mem))
    fit = device_fit(CostModel(trace, H200), p)
    assert fits and fit.survives and fit.retries_per_step > 0 and fit.retry_s > 0
    assert prediction.step_time_s == pytest.approx(estimate(trace, p, H200).time.step_time_s + fit.retry_s)
    assert judge.step_time_s(p, H200) == prediction.step_time_s


def test_a_cpu_profile_keeps_the_allocated_peak_verdict(trace_and_plan):
    trace, plan = trace_and_plan
    cpu = load_profile("cpu-gloo")
    base = estimate(trace, plan, cpu).prediction()
    judge = Judge(trace, estimate)
    assert judge.fit(plan, cpu) is None
    assert judge.judged(plan, cpu, base.peak_bytes) == (base, True)
    assert judge.judged(plan, cpu, base.peak_bytes - 1) == (base, False)


def _candidates(trace, plan, extra_mib):
    mem = H200.mem_for_tensor_budget(estimate(trace, plan, H200).memory.peak_bytes) + extra_mib * MIB
    p = _at(plan, mem)
    p = replace(p, predicted=estimate(trace, p, H200).prediction())
    return top_candidates(trace, p, H200, 12, solve=None, estimate=estimate), mem


def test_candidates_that_run_out_of_memory_on_the_gpu_are_dropped(trace_and_plan):
    """On the --mem whose search budget just holds the solver's plan, three of its neighbours' allocated
    peaks fit too but their simulated allocators run out of memory: they are not candidates."""
    trace, plan = trace_and_plan
    cands, mem = _candidates(trace, plan, 0)
    cm = CostModel(trace, H200)
    assert all(device_fit(cm, c.plan).survives for c in cands if c.source != "solver")
    dropped = {"prefetch 1/1", "prefetch 2/1", "all reshard"}
    neighbours = {src: q for q, src in _neighbours(_at(plan, mem))}
    assert all(estimate(trace, neighbours[src], H200).memory.peak_bytes <= H200.tensor_budget_bytes(mem)
               and not device_fit(cm, neighbours[src]).survives for src in dropped)
    assert not dropped & {c.source for c in cands}


def test_candidates_are_ranked_by_their_priced_step_time(trace_and_plan):
    trace, plan = trace_and_plan
    cands, _ = _candidates(trace, plan, 250)
    cm = CostModel(trace, H200)
    assert len(cands) > 1 and any(device_fit(cm, c.plan).retry_s > 0 for c in cands)
    for c in cands:
        fit = device_fit(cm, c.plan)
        assert c.plan.predicted.step_time_s == pytest.approx(estimate(trace, c.plan, H200).time.step_time_s
                                                             + fit.retry_s)
    assert [c.plan.predicted.step_time_s for c in cands] == sorted(c.plan.predicted.step_time_s for c in cands)
