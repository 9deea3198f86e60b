"""Reserved memory: the memory walk through the caching-allocator simulation over two steps
(shard_planner/cost/reserved.py)."""

import pytest

from shard_planner.cost import CostModel
from shard_planner.cost.allocations import ACTIVATIONS, OPTIMIZER_STATES, OVERHEAD, SHARDED_PARAMS, Stream
from shard_planner.cost.allocator import AllocatorConfig
from shard_planner.cost.allocator_accountant import AllocatorAccountant
from shard_planner.cost.reserved import TwoSteps
from shard_planner.cost.schedule import Phase
from shard_planner.hardware.profile import load_profile
from tests.cost.test_cost_model import synth_plan
from tests.models import cost_synth

MIB = 2**20
D = Stream.DEFAULT


def _walk(steps: TwoSteps, level_mib: list[int]) -> None:
    """One step as the memory walk emits it: the step state (sharded parameters, optimizer states, the
    overhead, then the batch), then the activation level at each mark, then the optimizer step."""
    steps.on_alloc(SHARDED_PARAMS, 100 * MIB, "", D)
    steps.on_alloc(OPTIMIZER_STATES, 200 * MIB, "", D)
    steps.on_alloc(OVERHEAD, 500 * MIB, "", D)
    steps.on_alloc(ACTIVATIONS, 10 * MIB, "", D)
    level = 10 * MIB
    for mib in level_mib:
        steps.on_free(ACTIVATIONS, level, "", D)
        level = mib * MIB
        steps.on_alloc(ACTIVATIONS, level, "", D)
        steps.on_mark("", "block", Phase.FORWARD, 0.0, 0.0, D)
    steps.on_mark("step", "", Phase.OPTIMIZER, 0.0, 0.0, D)


def test_two_steps_defer_the_states_and_walk_the_state_once():
    """Step 1 allocates the optimizer states at the optimizer step, not before the forward; step 2 does
    not allocate the persistent state again; the overhead stays outside the allocator."""
    inner = AllocatorAccountant(AllocatorConfig())
    steps = TwoSteps(inner)
    _walk(steps, [40, 70, 30, 10])
    first = inner.stats()
    # the states come after the activations are freed: the peak is at the step (100 + 200 + 10 MiB), not
    # the activations' peak beside the states (100 + 200 + 70 MiB) as from step 2 on
    assert first.peak_allocated_bytes == (100 + 200 + 10) * MIB
    assert first.allocated_bytes == (100 + 200 + 10) * MIB
    steps.next_step()
    _walk(steps, [40, 70, 30, 10])
    second = inner.stats()
    assert second.allocated_bytes == first.allocated_bytes  # the step is freed as it was made
    assert second.peak_allocated_bytes == (100 + 200 + 70) * MIB  # states beside the activations now
    assert inner.outside_bytes == 500 * MIB


def test_activations_are_a_stack_of_rises():
    """A rise of the level is one allocation of the rise; a fall frees the newest, the last in part."""
    inner = AllocatorAccountant(AllocatorConfig())
    steps = TwoSteps(inner)
    _walk(steps, [40, 70])
    assert steps.stack == [10 * MIB, 30 * MIB, 30 * MIB]
    steps.on_free(ACTIVATIONS, 70 * MIB, "", D)
    steps.on_alloc(ACTIVATIONS, 25 * MIB, "", D)
    assert steps.stack == [10 * MIB, 15 * MIB] and inner.allocator.allocated_bytes >= 25 * MIB


@pytest.fixture(scope="module")
def model_and_plan():
    trace = cost_synth.synthetic_trace(layers=8)
    return CostModel(trace, load_profile("h200")), synth_plan(trace, 8, mb=1)


def test_reserved_covers_the_allocated_peak_in_both_modes(model_and_plan):
    cm, plan = model_and_plan
    est = cm.estimate(plan, timeline=False)
    for expandable in (True, False):
        r = cm.reserved(plan, expandable_segments=expandable)
        allocated = est.memory.peak_bytes - est.memory.memory_at_peak["overhead"]
        assert r.outside_bytes == est.memory.memory_at_peak["overhead"]
        # the walk's peak, each allocation rounded up by the allocator (512 B, or a page)
        assert allocated <= r.allocated_peak_bytes <= allocated * 1.01
        assert r.allocated_peak_bytes <= r.reserved_peak_bytes <= r.no_retry_bytes
        assert r.num_alloc_retries == 0 and r.oom_at is None
    assert cm.reserved(plan, True).reserved_peak_bytes < cm.reserved(plan, False).reserved_peak_bytes


def test_under_a_small_device_the_step_retries_or_fails(model_and_plan):
    cm, plan = model_and_plan
    free = cm.reserved(plan, expandable_segments=True)
    tight = cm.reserved(plan, expandable_segments=True, device_bytes=free.allocated_peak_bytes * 99 // 100)
    assert tight.oom_at is not None and tight.num_alloc_retries >= 1
    roomy = cm.reserved(plan, expandable_segments=True, device_bytes=free.no_retry_bytes)
    assert roomy.oom_at is None and roomy.num_alloc_retries == 0


def test_retries_per_step_are_the_second_steps(model_and_plan):
    """Under a device a little above the allocated peak the steps survive with retries: those of the second
    step are the ones every later step repeats ([Note: Two steps, not one]), a part of the two steps' count."""
    cm, plan = model_and_plan
    free = cm.reserved(plan, expandable_segments=True)
    for device in (free.allocated_peak_bytes + 64 * MIB, free.no_retry_bytes):
        r = cm.reserved(plan, expandable_segments=True, device_bytes=device)
        assert 0 <= r.retries_per_step <= r.num_alloc_retries
    assert cm.reserved(plan, True, free.no_retry_bytes).num_alloc_retries == 0


def test_reserved_timeline_has_a_mark_per_timeline_event(model_and_plan):
    """The second step's allocator state at every mark of the walk, one per event of the estimate's memory
    timeline, reserved never below allocated and never above the two steps' reserved peak."""
    cm, plan = model_and_plan
    events = cm.estimate(plan, timeline=True).memory.timeline
    free = cm.reserved(plan, expandable_segments=True)
    line = cm.reserved_timeline(plan, expandable_segments=True)
    assert len(line.marks) == len(events) and line.outside_bytes == free.outside_bytes
    assert all(m[2] == e.phase for m, e in zip(line.marks, events))
    assert all(allocated <= reserved <= free.reserved_peak_bytes for *_, allocated, reserved in line.marks)
    capped = cm.reserved_timeline(plan, expandable_segments=True, device_bytes=free.allocated_peak_bytes * 99 // 100)
    assert len(capped.marks) < len(events)  # it ran out of memory on the way


def test_the_simulated_calls_replay_to_the_same_allocator(model_and_plan):
    """The allocator's calls over the two steps (CostModel.reserved_events), replayed by cost/allocator_replay.py,
    reserve and allocate exactly what the walk's simulation did; under a device cap they survive from the
    bisection's boundary on."""
    from shard_planner.cost.allocator_replay import CapKind, replay, smallest_surviving_cap

    cm, plan = model_and_plan
    for expandable in (True, False):
        events = cm.reserved_events(plan, expandable_segments=expandable)
        stats, walked = replay(events, AllocatorConfig(expandable_segments=expandable)), cm.reserved(plan, expandable)
        assert (stats.peak_reserved_bytes, stats.peak_allocated_bytes, stats.peak_cap_demand_bytes) == (
            walked.reserved_peak_bytes, walked.allocated_peak_bytes, walked.no_retry_bytes)
    events = cm.reserved_events(plan, expandable_segments=True)
    cap = smallest_surviving_cap(events, True, CapKind.DEVICE)
    assert cm.reserved(plan, True, cap).oom_at is None
