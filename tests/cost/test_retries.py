"""The price of the caching allocator's retries (shard_planner/cost/retries.py): what each retry releases
(cost/allocator.py ``RetryRelease``, cost/reserved.py ``StepRetry``) and the seconds it costs a step."""

from dataclasses import replace

import pytest

from shard_planner.cost import CostModel
from shard_planner.cost.allocator import AllocatorConfig, CachingAllocator, RetryRelease
from shard_planner.cost.fits import device_fit
from shard_planner.cost.reserved import ReservedEstimate, StepRetry
from shard_planner.cost.retries import price_retries, sync_exposed_s
from shard_planner.cost.types import TimeEstimate, UnitTime
from shard_planner.hardware.profile import load_profile
from tests.cost.test_cost_model import synth_plan
from tests.models import cost_synth

MIB, GIB = 2**20, 2**30
H200 = load_profile("h200")


def test_a_retry_records_the_segments_it_frees():
    """30 MiB freed and cached, then 40 MiB on a 60 MiB device: the new segment does not fit beside the
    cached one, so the retry cudaFrees it (one call, 30 MiB) and allocates again (the second cudaMalloc)."""
    a = CachingAllocator(AllocatorConfig(device_bytes=60 * MIB))
    a.free(a.malloc(30 * MIB))
    a.malloc(40 * MIB)
    stats = a.stats()
    assert stats.retry_releases == (RetryRelease(free_calls=1, freed_bytes=30 * MIB, alloc_calls_before=1),)
    assert (stats.device_alloc_calls, stats.device_free_calls, stats.num_alloc_retries) == (2, 1, 1)


def test_an_expandable_retry_records_the_pages_it_unmaps():
    """30 MiB on stream 0 maps two 20 MiB pages; freed, then 30 MiB on stream 1 (its own segment) needs two
    more pages, 80 MiB on a 60 MiB device: the retry unmaps stream 0's two pages and maps two again."""
    a = CachingAllocator(AllocatorConfig(expandable_segments=True, device_bytes=60 * MIB))
    a.free(a.malloc(30 * MIB, stream=0))
    a.malloc(30 * MIB, stream=1)
    stats = a.stats()
    assert stats.retry_releases == (RetryRelease(free_calls=2, freed_bytes=40 * MIB, alloc_calls_before=2),)
    assert (stats.device_alloc_calls, stats.device_free_calls) == (4, 2)


def _time(step_s=1.0, comm_s=0.5, exposed_s=0.1, collectives_s=((0.02, 0.03), (0.05, 0.01))) -> TimeEstimate:
    units = tuple(UnitTime(f"u{i}", 0.1, 0.2, ag, rs, 0.0) for i, (ag, rs) in enumerate(collectives_s))
    return TimeEstimate(step_s, 0.6, comm_s, exposed_s, 0.05, 8.0, None, 0.4, units)


def _capped(expandable: bool, retries: tuple[StepRetry, ...], forced: int) -> ReservedEstimate:
    return ReservedEstimate(expandable, 40 * GIB, 30 * GIB, 39 * GIB, GIB, 45 * GIB, num_alloc_retries=len(retries) + 1,
                            oom_at=None, retries_per_step=len(retries), step_retries=retries,
                            forced_alloc_calls_per_step=forced)


@pytest.mark.parametrize("expandable", [False, True])
def test_the_price_is_the_formula(expandable):
    """sync: min(retries x the longest collective, the communication the step hid); the driver calls at the
    profile's per-call times (cudaFree / cudaMalloc, or page unmap / map)."""
    retries = (StepRetry(3, 3 * GIB, 2), StepRetry(1, GIB, 1))
    price = price_retries(_capped(expandable, retries, forced=5), _time(), H200)
    per_free, per_alloc = (H200.page_unmap_s, H200.page_map_s) if expandable else (H200.cuda_free_s, H200.cuda_malloc_s)
    assert per_free > 0 and per_alloc > 0
    assert price.sync_s == pytest.approx(min(2 * 0.05, 0.5 - 0.1))
    assert price.free_s == pytest.approx(4 * per_free)
    assert price.alloc_s == pytest.approx(5 * per_alloc)
    assert price.total_s == pytest.approx(0.1 + 4 * per_free + 5 * per_alloc)
    assert (price.free_calls_per_step, price.freed_bytes_per_step, price.forced_alloc_calls_per_step) == (4, 4 * GIB, 5)
    assert price.share == pytest.approx(price.total_s / 1.0)


def test_the_synchronisation_exposes_at_most_what_the_step_hid():
    assert sync_exposed_s(_time(comm_s=0.5, exposed_s=0.45), retries=4) == pytest.approx(0.05)
    assert sync_exposed_s(_time(), retries=0) == 0.0


def test_no_retries_cost_nothing():
    price = price_retries(_capped(False, (), forced=0), _time(), H200)
    assert price.total_s == 0.0 and price.retries_per_step == 0
    failing = replace(_capped(False, (StepRetry(1, GIB, 1),), forced=1), oom_at="forward of layers.3")
    assert price_retries(failing, _time(), H200).total_s == 0.0  # no step to price


@pytest.fixture(scope="module")
def model_and_plan():
    trace = cost_synth.synthetic_trace(layers=8)
    return CostModel(trace, H200), synth_plan(trace, 8, mb=1)


def _retrying_plan(cm, plan, expandable):
    """``plan`` on the smallest --mem (in 64 MiB steps above the allocated peak) where its steps survive with
    retries in every step."""
    free = cm.reserved(plan, expandable)
    for k in range(200):
        cap = free.allocated_peak_bytes + k * 64 * MIB
        mem = free.outside_bytes + int(cap / H200.usable_fraction) + 1
        p = replace(plan, cluster=replace(plan.cluster, mem_budget_bytes=mem, expandable_segments=expandable))
        fit = device_fit(cm, p)
        if fit.survives and fit.retries_per_step:
            return p, fit
    raise AssertionError("no --mem where the steps survive with retries")


@pytest.mark.parametrize("expandable", [False, True])
def test_a_plan_that_retries_has_its_step_time_priced(model_and_plan, expandable):
    cm, plan = model_and_plan
    p, fit = _retrying_plan(cm, plan, expandable)
    assert len(fit.capped.step_retries) == fit.retries_per_step
    assert fit.retry_price == price_retries(fit.capped, cm.time(p), H200) and fit.retry_s > 0
    base = cm.estimate(p, timeline=False).prediction()
    priced = fit.priced(base)
    assert priced.step_time_s == pytest.approx(base.step_time_s + fit.retry_s)
    assert priced.samples_per_s == pytest.approx(base.samples_per_s * base.step_time_s / priced.step_time_s)
    assert priced.alloc_retry_s == fit.retry_s and priced.alloc_retries_per_step == fit.retries_per_step
    assert f"costing {fit.retry_s * 1e3:.3g} ms per step" in fit.verdict()
    assert priced.retries_text().startswith(f"fits with {fit.retries_per_step} retries per step, costing ")


def test_a_plan_without_retries_keeps_its_step_time(model_and_plan):
    cm, plan = model_and_plan
    p = replace(plan, cluster=replace(plan.cluster, mem_budget_bytes=H200.memory_bytes))
    fit = device_fit(cm, p)
    assert fit.survives and fit.retries_per_step == 0 and fit.retry_price is None
    base = cm.estimate(p, timeline=False).prediction()
    assert fit.priced(base).step_time_s == base.step_time_s and fit.priced(base).alloc_retry_s == 0.0
    assert fit.priced(base).retries_text() == "no retries on --mem"
