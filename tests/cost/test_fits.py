"""Whether a plan fits a GPU (shard_planner/cost/fits.py): its two simulated steps survive the memory the
caching allocator gets there, ``usable_fraction`` of --mem less what is outside the allocator."""

from dataclasses import replace

import pytest

from shard_planner.cost import CostModel
from shard_planner.cost.allocator_replay import CAP_GRAIN_BYTES
from shard_planner.cost.fits import (
    GPU_USABLE_FRACTION, allocator_bytes, device_fit, smallest_mem_bytes, smallest_surviving_bytes,
)
from shard_planner.hardware.profile import load_profile
from tests.cost.test_cost_model import synth_plan
from tests.models import cost_synth

GIB, MIB = 2**30, 2**20
H200 = load_profile("h200")


def _with_mem(plan, mem_bytes, expandable=True):
    return replace(plan, cluster=replace(plan.cluster, mem_budget_bytes=mem_bytes, expandable_segments=expandable))


@pytest.fixture(scope="module")
def model_and_plan():
    trace = cost_synth.synthetic_trace(layers=8)
    return CostModel(trace, H200), synth_plan(trace, 8, mb=1)


def test_the_allocator_gets_the_margin_of_what_is_not_outside_it():
    assert H200.usable_fraction == GPU_USABLE_FRACTION
    assert allocator_bytes(H200, 40 * GIB, GIB) == int(39 * GIB * 0.947)
    assert allocator_bytes(H200, 10**15, GIB) == int((H200.memory_bytes - GIB) * 0.947)  # the device caps --mem
    assert allocator_bytes(H200, GIB // 2, GIB) == 0


def test_a_cpu_profile_has_no_caching_allocator(model_and_plan):
    _, plan = model_and_plan
    assert device_fit(CostModel(cost_synth.synthetic_trace(layers=8), load_profile("cpu-gloo")), plan) is None


def test_a_roomy_gpu_fits_without_retries(model_and_plan):
    cm, plan = model_and_plan
    fit = device_fit(cm, _with_mem(plan, 80 * GIB))
    assert fit.survives and fit.retries_per_step == 0 and fit.oom_at is None and fit.expandable_segments
    assert fit.allocator_bytes == allocator_bytes(H200, 80 * GIB, fit.outside_bytes)
    assert fit.reserved_peak_total_bytes == fit.free.reserved_peak_bytes + fit.outside_bytes
    assert fit.prediction_fields() == {"reserved_peak_bytes": fit.reserved_peak_total_bytes,
                                       "no_retry_bytes": fit.no_retry_total_bytes, "alloc_retries_per_step": 0,
                                       "alloc_retry_s": 0.0}
    assert fit.verdict() == "fits 80.00 GiB without retries"
    assert "expandable_segments:True" in fit.describe() and "less the 5.3% margin" in fit.describe()


def test_the_plans_allocator_mode_is_judged(model_and_plan):
    cm, plan = model_and_plan
    assert not device_fit(cm, _with_mem(plan, 80 * GIB, expandable=False)).expandable_segments
    default, expandable = (device_fit(cm, _with_mem(plan, 80 * GIB, e)) for e in (False, True))
    assert expandable.free.reserved_peak_bytes <= default.free.reserved_peak_bytes


def test_below_the_smallest_surviving_memory_it_does_not_fit(model_and_plan):
    """The smallest allocator memory the steps survive is a boundary: they survive it and run out of memory
    2 MiB below it; the smallest --mem it names fits, and 2 MiB of allocator memory less does not."""
    cm, plan = model_and_plan
    roomy = device_fit(cm, _with_mem(plan, 80 * GIB))
    smallest = smallest_surviving_bytes(cm, plan, roomy)
    assert smallest % CAP_GRAIN_BYTES == 0 and smallest <= roomy.free.no_retry_bytes + CAP_GRAIN_BYTES
    assert cm.reserved(plan, True, smallest).oom_at is None
    assert cm.reserved(plan, True, smallest - CAP_GRAIN_BYTES).oom_at is not None
    peak = cm.estimate(plan, timeline=False).memory.peak_bytes
    mem = smallest_mem_bytes(cm, plan, roomy, peak)
    fit = device_fit(cm, _with_mem(plan, mem))
    assert fit.survives and fit.allocator_bytes >= smallest
    tight = device_fit(cm, _with_mem(plan, mem - 4 * MIB))
    if tight.allocator_bytes < smallest:
        assert not tight.survives and "DOES NOT FIT" in tight.verdict() and tight.oom_at in tight.verdict()
        assert smallest_surviving_bytes(cm, plan, tight) == smallest  # the same boundary, from below
