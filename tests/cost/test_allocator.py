"""The caching-allocator simulation (cost/allocator.py and its companions) against the allocator's
documented behaviour: each figure derived in the test's docstring from the rules the module's notes cite
(c10/cuda/CUDACachingAllocator.cpp)."""

import random
from dataclasses import replace

import pytest

from shard_planner.cost.allocations import Kind, Stream
from shard_planner.cost.allocator import (
    MiB, AllocatorConfig, AllocatorOutOfMemory, CachingAllocator, allocation_size, round_size,
)
from shard_planner.cost.allocator_accountant import AllocatorAccountant
from shard_planner.cost.allocator_replay import (
    ALLOC, CAP_GRAIN_BYTES, FREE, AllocEvent, CapKind, events_from_snapshot, events_from_trace, replay,
    smallest_surviving_cap,
)
from shard_planner.cost.schedule import Phase

KiB = 1024


def allocator(expandable=False, **limits) -> CachingAllocator:
    return CachingAllocator(AllocatorConfig(expandable_segments=expandable, **limits))


def blocks_mib(a: CachingAllocator) -> list[list[tuple[float, bool]]]:
    """Each segment's blocks as (MiB, allocated)."""
    return [[(size / MiB, allocated) for size, allocated in s.blocks] for s in a.segments()]


def check_consistent(a: CachingAllocator) -> None:
    """The segments add up to the counters, and no two free blocks of a segment touch (they merge)."""
    segments = a.segments()
    assert sum(s.total_bytes for s in segments) == a.reserved_bytes
    assert sum(s.allocated_bytes for s in segments) == a.allocated_bytes
    for s in segments:
        states = [allocated for _, allocated in s.blocks]
        assert not any(not x and not y for x, y in zip(states, states[1:])), s


# -- sizes, pools, segments ----------------------------------------------------------------------------------

def test_sizes_round_up_to_512_bytes():
    """[Note: Rounding and the two pools]: below 512 B a request takes 512 B, else the next multiple of
    512 B; the allocation counts the rounded block, the request its own bytes."""
    assert [round_size(n) for n in (1, 511, 512, 513, 1000, 1536)] == [512, 512, 512, 1024, 1024, 1536]
    a = allocator()
    a.malloc(1000)
    a.malloc(1)
    assert (a.allocated_bytes, a.requested_bytes) == (1024 + 512, 1001)
    with pytest.raises(ValueError):
        a.malloc(0)


def test_small_requests_pack_into_2_mib_segments():
    """Up to 1 MiB (kSmallSize) a request comes from the small pool's 2 MiB (kSmallBuffer) segments: four
    512 KiB requests fill one segment, a fifth needs a second. 1 MiB + 1 B is a large request: a 20 MiB
    segment of the large pool."""
    a = allocator()
    for _ in range(4):
        a.malloc(512 * KiB)
    assert a.reserved_bytes == 2 * MiB and [s.pool for s in a.segments()] == ["small"]
    a.malloc(512 * KiB)
    assert a.reserved_bytes == 4 * MiB
    a.malloc(1 * MiB)  # exactly kSmallSize: still small; the second segment has 1.5 MiB left
    assert a.reserved_bytes == 4 * MiB
    a.malloc(1 * MiB + 1)
    assert a.reserved_bytes == 24 * MiB and sorted(s.pool for s in a.segments()) == ["large", "small", "small"]


def test_the_10_mib_boundary():
    """get_allocation_size: below kMinLargeAlloc (10 MiB) a large request gets a 20 MiB segment (9 MiB ->
    20 MiB, the rest split off for later requests); from 10 MiB on, its own size rounded up to 2 MiB
    (10 -> 10, 11 -> 12 MiB)."""
    assert [allocation_size(n * MiB) // MiB for n in (1, 2, 9, 10, 11, 13)] == [2, 20, 20, 10, 12, 14]
    for request_mib, segment_mib in ((9, 20), (10, 10), (11, 12)):
        a = allocator()
        a.malloc(request_mib * MiB)
        assert a.reserved_bytes == segment_mib * MiB
    a = allocator()
    a.malloc(9 * MiB)
    a.malloc(9 * MiB)  # fits the 11 MiB left of the first 9 MiB's 20 MiB segment
    assert a.reserved_bytes == 20 * MiB and blocks_mib(a) == [[(9, True), (9, True), (2, False)]]


def test_splitting_rules():
    """should_split: the large pool of cudaMalloc segments splits only when more than 1 MiB would remain
    (20 MiB segment: 18.5 MiB splits off 1.5 MiB, 19 MiB takes the whole 20 MiB block); the small pool,
    and with expandable segments both pools, split when 512 B or more remain."""
    a = allocator()
    a.malloc(int(18.5 * MiB))
    assert blocks_mib(a) == [[(18.5, True), (1.5, False)]]
    a = allocator()
    a.malloc(3 * MiB)
    a.malloc(16 * MiB)  # 17 MiB left of the 20 MiB segment: 1 MiB would remain, not more -> no split
    assert blocks_mib(a) == [[(3, True), (17, True)]] and a.allocated_bytes == 20 * MiB
    a = allocator()
    a.malloc(1 * MiB)
    a.malloc(1 * MiB - 512)  # small pool: 512 B remain -> split
    assert [s.blocks for s in a.segments()] == [((1 * MiB, True), (1 * MiB - 512, True), (512, False))]
    a = allocator(expandable=True)
    a.malloc(19 * MiB)  # one 20 MiB page; 1 MiB remains -> split with expandable segments
    assert blocks_mib(a) == [[(19, True), (1, False)]] and a.allocated_bytes == 19 * MiB


def test_blocks_freed_on_one_stream_are_reused_by_that_stream_only():
    """[Note: Best fit per stream]: a 16 MiB block cached by stream 0 is not given to stream 1, which gets
    a segment of its own; stream 0 reuses it. With expandable segments each (pool, stream) grows its own
    segment."""
    a = allocator()
    a.free(a.malloc(16 * MiB, stream=0))
    a.malloc(16 * MiB, stream=1)
    assert a.reserved_bytes == 32 * MiB
    a.malloc(16 * MiB, stream=0)
    assert a.reserved_bytes == 32 * MiB
    assert [(s.stream, s.allocated_bytes) for s in a.segments()] == [(0, 16 * MiB), (1, 16 * MiB)]
    e = allocator(expandable=True)
    e.free(e.malloc(4 * MiB, stream=0))
    e.malloc(4 * MiB, stream=1)
    assert e.reserved_bytes == 40 * MiB and [s.stream for s in e.segments()] == [0, 1]
    assert [s.stream for s in e.segments(stream=1)] == [1]


def test_adjacent_free_blocks_merge():
    """[Note: Merging free neighbours]: three 5 MiB blocks of one 20 MiB segment; freeing the first and the
    third leaves the third merged with the free 5 MiB tail (10 MiB) and the first alone (the second sits
    between); freeing the second merges all into the whole 20 MiB segment again, which a 20 MiB request
    then takes without a new segment."""
    a = allocator()
    first, second, third = (a.malloc(5 * MiB) for _ in range(3))
    assert blocks_mib(a) == [[(5, True), (5, True), (5, True), (5, False)]]
    a.free(first)
    a.free(third)
    assert blocks_mib(a) == [[(5, False), (5, True), (10, False)]]
    a.free(second)
    assert blocks_mib(a) == [[(20, False)]]
    a.malloc(20 * MiB)
    assert a.reserved_bytes == 20 * MiB


def test_best_fit_takes_the_smallest_block_that_fits():
    """get_free_block: of cached 12, 16 and 14 MiB blocks (each its own segment) a 13 MiB request takes the
    14 MiB one, whole (1 MiB would remain: not more than kSmallSize)."""
    a = allocator()
    handles = [a.malloc(n * MiB) for n in (12, 16, 14)]
    for h in handles:
        a.free(h)
    a.malloc(13 * MiB)
    assert [(s.total_bytes // MiB, s.allocated_bytes // MiB) for s in a.segments()] == [(12, 0), (16, 0), (14, 14)]


def test_expandable_best_fit_keeps_the_growing_end_free():
    """[Note: Best fit in an expandable segment]: one 20 MiB page holding 8 MiB (freed) and 5 MiB, and the
    7 MiB free end. A 6 MiB request: by size the 7 MiB end fits best, but it counts as 7 MiB plus the
    unmapped rest, so the 8 MiB interior block is taken (6 MiB, 2 MiB left)."""
    a = allocator(expandable=True)
    first = a.malloc(8 * MiB)
    a.malloc(5 * MiB)
    a.free(first)
    a.malloc(6 * MiB)
    assert blocks_mib(a) == [[(6, True), (2, False), (5, True), (7, False)]]


# -- the documented orders ----------------------------------------------------------------------------------

def _eight_16_then_four_32(a):
    small = [a.malloc(16 * MiB) for _ in range(8)]
    for h in small:
        a.free(h)
    return [a.malloc(32 * MiB) for _ in range(4)]


def _four_32_then_eight_16(a):
    large = [a.malloc(32 * MiB) for _ in range(4)]
    for h in large:
        a.free(h)
    return [a.malloc(16 * MiB) for _ in range(8)]


def test_small_then_large_reserves_256_mib_without_expandable_segments():
    """8 x 16 MiB: 16 MiB >= kMinLargeAlloc, so each is a cudaMalloc of its own 16 MiB (128 MiB). Freed,
    they stay eight separate cached segments that cannot merge. 4 x 32 MiB: no cached block is >= 32 MiB,
    so four new 32 MiB segments: 128 + 128 = 256 MiB reserved."""
    a = allocator()
    _eight_16_then_four_32(a)
    assert (a.reserved_bytes, a.peak_reserved_bytes) == (256 * MiB, 256 * MiB)
    assert sorted(s.total_bytes // MiB for s in a.segments()) == [16] * 8 + [32] * 4
    check_consistent(a)


def test_large_then_small_reserves_128_mib_without_expandable_segments():
    """4 x 32 MiB: four 32 MiB segments (128 MiB). Freed and cached, each serves two 16 MiB requests: the
    first splits it (16 MiB would remain, more than kSmallSize), the second takes the remainder."""
    a = allocator()
    _four_32_then_eight_16(a)
    assert (a.reserved_bytes, a.peak_reserved_bytes) == (128 * MiB, 128 * MiB)
    assert blocks_mib(a) == [[(16, True), (16, True)]] * 4
    check_consistent(a)


def test_expandable_segments_reserve_140_mib_in_either_order():
    """One growing segment, 20 MiB pages. 8 x 16 MiB: the first maps a page and leaves 4 MiB free; each
    next one that does not fit the free end maps another page (free end 4 -> 8 -> 12 -> 16 MiB), the fifth
    takes the 16 MiB free end, and three more pages follow: 7 pages, 140 MiB, 12 MiB free at the end.
    Freed, it is one free 140 MiB block, which the 4 x 32 MiB split without a new page. The other order:
    the first 32 MiB maps 2 pages at once (40 MiB, 8 free), the second 2 more (8 + 40: 16 left), the third
    1 (16 + 20: 4 left), the fourth 2 (4 + 40: 12 left): 140 MiB in 4 map calls, and the 8 x 16 MiB fit."""
    for order, map_calls in ((_eight_16_then_four_32, 7), (_four_32_then_eight_16, 4)):
        a = allocator(expandable=True)
        order(a)
        assert (a.reserved_bytes, a.peak_reserved_bytes) == (140 * MiB, 140 * MiB), order.__name__
        assert len(a.segments()) == 1 and a.num_device_alloc == map_calls
        check_consistent(a)


# -- the cap, release and retry, OOM -------------------------------------------------------------------------

def test_the_cap_releases_cached_segments_and_retries():
    """Cap 64 MiB. A cached (freed) 32 MiB segment; a 40 MiB request finds no cached block >= 40 MiB, and a
    new segment would make 72 MiB > 64: release_cached_blocks frees the cached segment and the retry
    (num_alloc_retries 1) fits: 40 MiB reserved."""
    a = allocator(cap_bytes=64 * MiB)
    a.free(a.malloc(32 * MiB))
    a.malloc(40 * MiB)
    assert (a.num_alloc_retries, a.num_ooms) == (1, 0)
    assert (a.reserved_bytes, a.peak_reserved_bytes) == (40 * MiB, 40 * MiB)
    assert (a.num_device_alloc, a.num_device_free) == (2, 1)


def test_release_frees_whole_segments_only():
    """A segment with an allocation in it is not released, even mostly free: cap 40 MiB, a 5 MiB block in
    a 20 MiB segment (15 MiB free) and a freed 16 MiB segment; a 20 MiB request fits neither and a new
    segment would make 56 MiB: the release frees the 16 MiB segment only, and the retry fits (20 + 20)."""
    a = allocator(cap_bytes=40 * MiB)
    a.malloc(5 * MiB)
    a.free(a.malloc(16 * MiB))
    a.malloc(20 * MiB)
    assert a.num_alloc_retries == 1 and a.reserved_bytes == 40 * MiB
    assert blocks_mib(a) == [[(5, True), (15, False)], [(20, True)]]


def test_oom_under_the_cap():
    """Cap 64 MiB with 32 MiB allocated: a 40 MiB request finds nothing to release, the retry fails too,
    and the OOM counts one retry and one OOM; the report says what was asked and the state then. The
    allocator stays usable."""
    a = allocator(cap_bytes=64 * MiB)
    live = a.malloc(32 * MiB)
    with pytest.raises(AllocatorOutOfMemory) as raised:
        a.malloc(40 * MiB + 1, stream=3)
    report = raised.value.report
    assert (report.request_bytes, report.rounded_bytes, report.segment_bytes) == (40 * MiB + 1, 40 * MiB + 512,
                                                                                  42 * MiB)
    assert (report.stream, report.allocated_bytes, report.reserved_bytes, report.cap_bytes) == (
        3, 32 * MiB, 32 * MiB, 64 * MiB)
    assert (a.num_alloc_retries, a.num_ooms) == (1, 1)
    assert "32.0 MiB allocated" in str(raised.value) and "cap 64.0 MiB" in str(raised.value)
    a.free(live)
    a.malloc(40 * MiB + 1)
    assert a.allocated_bytes == 40 * MiB + 512


def test_the_device_limit_counts_pages_and_the_cap_counts_segments():
    """[Note: The cap and the device's memory], with expandable segments: 11 MiB maps a 20 MiB page. Under a
    12 MiB cap the check (0 + 12 MiB segment size) passes and reserved ends at 20 MiB, above the cap; with
    12 MiB of device memory the page cannot be mapped: OOM. With a 9 MiB free end (after 11 MiB), a 9 MiB
    request fits the free end without new memory; a second 9 MiB request needs a new page."""
    a = allocator(expandable=True, cap_bytes=12 * MiB)
    a.malloc(11 * MiB)
    assert a.reserved_bytes == 20 * MiB and a.num_alloc_retries == 0
    with pytest.raises(AllocatorOutOfMemory):
        allocator(expandable=True, device_bytes=12 * MiB).malloc(11 * MiB)
    a = allocator(expandable=True, device_bytes=40 * MiB)
    a.malloc(11 * MiB)
    a.malloc(9 * MiB)
    assert a.reserved_bytes == 20 * MiB
    a.malloc(9 * MiB)
    assert a.reserved_bytes == 40 * MiB
    with pytest.raises(AllocatorOutOfMemory):
        a.malloc(20 * MiB)


def test_expandable_release_unmaps_the_free_pages():
    """8 x 16 MiB map 140 MiB; the first seven freed make one free block [0, 112) MiB, the last is live at
    [112, 128), 12 MiB free after it. Releasing unmaps the whole pages inside the free blocks: [0, 100);
    [100, 112) and [128, 140) hold no whole page and stay. 40 MiB reserved. The next 16 MiB request maps
    at the lowest address, the hole: one page, 60 MiB."""
    a = allocator(expandable=True)
    handles = [a.malloc(16 * MiB) for _ in range(8)]
    for h in handles[:7]:
        a.free(h)
    a.empty_cache()
    assert a.reserved_bytes == 40 * MiB and a.num_device_free == 1
    assert blocks_mib(a) == [[(12, False), (16, True), (12, False)]]
    a.malloc(16 * MiB)
    assert a.reserved_bytes == 60 * MiB
    assert blocks_mib(a) == [[(16, True), (4, False)], [(12, False), (16, True), (12, False)]]
    a.free(handles[7])
    a.empty_cache()
    assert blocks_mib(a) == [[(16, True), (4, False)]] and a.reserved_bytes == 20 * MiB


def test_an_expandable_segment_released_whole_is_destroyed():
    a = allocator(expandable=True)
    a.free(a.malloc(30 * MiB))
    a.empty_cache()
    assert a.reserved_bytes == 0 and a.segments() == ()
    a.malloc(1 * MiB)  # the small pool: a 2 MiB page of a new segment
    assert a.reserved_bytes == 2 * MiB


def test_free_of_an_unknown_handle_raises():
    a = allocator()
    h = a.malloc(4096)
    a.free(h)
    with pytest.raises(ValueError):
        a.free(h)


@pytest.mark.parametrize("expandable", [False, True])
def test_random_sequences_stay_consistent(expandable):
    """Random allocations (both pools, two streams) and frees, with a cap that forces releases: after every
    call the segments add up to the counters and no free blocks touch; peaks bound the currents."""
    rng = random.Random(7)
    a = allocator(expandable, cap_bytes=300 * MiB)
    live = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randrange(1, 1 * MiB), rng.randrange(1 * MiB, 10 * MiB), rng.randrange(10 * MiB, 40 * MiB)])
            try:
                live.append(a.malloc(size, stream=rng.choice([0, 1])))
            except AllocatorOutOfMemory:
                pass
        check_consistent(a)
        assert a.requested_bytes <= a.allocated_bytes <= a.reserved_bytes <= a.peak_reserved_bytes
    assert a.num_alloc_retries > 0


# -- replay and the smallest cap ------------------------------------------------------------------------------

def _events(*specs):
    """("a", key, MiB, stream) allocates, ("f", key) frees."""
    return [AllocEvent(ALLOC, s[1], int(s[2] * MiB), s[3] if len(s) > 3 else 0) if s[0] == "a"
            else AllocEvent(FREE, s[1], 0) for s in specs]


SMALL_THEN_LARGE = ([AllocEvent(ALLOC, i, 16 * MiB) for i in range(8)] + [AllocEvent(FREE, i, 0) for i in range(8)]
                    + [AllocEvent(ALLOC, 8 + i, 32 * MiB) for i in range(4)])


def test_replay_matches_the_allocator_and_stops_at_the_oom():
    stats = replay(SMALL_THEN_LARGE)
    assert (stats.peak_reserved_bytes, stats.peak_allocated_bytes, stats.survived) == (256 * MiB, 128 * MiB, True)
    assert replay(SMALL_THEN_LARGE, AllocatorConfig(expandable_segments=True)).peak_reserved_bytes == 140 * MiB
    capped = replay(SMALL_THEN_LARGE, AllocatorConfig(cap_bytes=100 * MiB))  # the 7th 16 MiB: 112 > 100
    assert not capped.survived and capped.oom.event_index == 6 and capped.num_ooms == 1
    assert capped.oom.reserved_bytes == 96 * MiB
    zero = replay(_events(("a", "x", 0), ("a", "y", 1), ("f", "x"), ("f", "y")))
    assert zero.peak_requested_bytes == 1 * MiB and zero.allocated_bytes == 0
    with pytest.raises(ValueError):
        replay(_events(("f", "x")))
    with pytest.raises(ValueError):
        replay(_events(("a", "x", 1), ("a", "x", 1)))


def test_smallest_surviving_cap_of_the_documented_orders():
    """Small then large survives a 128 MiB cap without expandable segments, half its uncapped 256 MiB: at
    the first 32 MiB request, 128 + 32 > 128, so the release frees the eight cached 16 MiB segments and the
    retry fits (one retry); 126 MiB cannot hold the 8 x 16 MiB. With expandable segments the cap sees
    segment sizes: the 7th page is mapped when 120 + 16 MiB <= cap, so 136 MiB survives (reserving 140,
    above the cap), while the device's memory must hold the 140 MiB mapped."""
    assert smallest_surviving_cap(SMALL_THEN_LARGE, False) == 128 * MiB
    assert replay(SMALL_THEN_LARGE, AllocatorConfig(cap_bytes=128 * MiB)).num_alloc_retries == 1
    assert smallest_surviving_cap(SMALL_THEN_LARGE, False, CapKind.DEVICE) == 128 * MiB
    assert smallest_surviving_cap(SMALL_THEN_LARGE, True) == 136 * MiB
    at_136 = replay(SMALL_THEN_LARGE, AllocatorConfig(expandable_segments=True, cap_bytes=136 * MiB))
    assert at_136.survived and at_136.peak_reserved_bytes == 140 * MiB
    assert smallest_surviving_cap(SMALL_THEN_LARGE, True, CapKind.DEVICE) == 140 * MiB
    assert smallest_surviving_cap([], False) == 0


def _survival_by_cap(events, expandable, limit):
    """Whether the replay survives each cap, every 2 MiB up to past the uncapped demand."""
    base = AllocatorConfig(expandable_segments=expandable)
    top = replay(events, base).peak_cap_demand_bytes // CAP_GRAIN_BYTES + 4
    return [replay(events, replace(base, **{limit.value: k * CAP_GRAIN_BYTES})).survived for k in range(top)]


def _fsdp_like_step(layers=6):
    """An FSDP-like step: per layer an all-gather output on the copy-in stream (stream 1) and the unsharded
    parameters on the default stream, activations kept until backward, a reduce-scatter output on stream 3,
    small temporaries in between."""
    ev, key = [], iter(range(10**6))
    saved = []
    for _ in range(layers):
        ag, params, act, tmp = next(key), next(key), next(key), next(key)
        ev += [AllocEvent(ALLOC, ag, 24 * MiB, 1), AllocEvent(ALLOC, params, 24 * MiB), AllocEvent(FREE, ag, 0),
               AllocEvent(ALLOC, act, 6 * MiB + 300), AllocEvent(ALLOC, tmp, 700 * KiB), AllocEvent(FREE, tmp, 0),
               AllocEvent(FREE, params, 0)]
        saved.append(act)
    for act in reversed(saved):
        ag, params, grad, rs = next(key), next(key), next(key), next(key)
        ev += [AllocEvent(ALLOC, ag, 24 * MiB, 1), AllocEvent(ALLOC, params, 24 * MiB), AllocEvent(FREE, ag, 0),
               AllocEvent(ALLOC, grad, 24 * MiB), AllocEvent(FREE, act, 0), AllocEvent(FREE, params, 0),
               AllocEvent(ALLOC, rs, 3 * MiB, 3), AllocEvent(FREE, grad, 0), AllocEvent(FREE, rs, 0)]
    return ev


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("limit", list(CapKind))
def test_bisection_finds_the_smallest_cap_where_survival_is_monotone(expandable, limit):
    """[Note: The smallest cap, by bisection] on the documented orders and an FSDP-like step: survival is
    monotone in the cap (fails below one cap, survives from it on), and the bisection returns that cap."""
    for events in (SMALL_THEN_LARGE, _fsdp_like_step()):
        survival = _survival_by_cap(events, expandable, limit)
        first = survival.index(True)
        assert all(survival[first:]) and not any(survival[:first])
        assert smallest_surviving_cap(events, expandable, limit) == first * CAP_GRAIN_BYTES


def test_survival_is_not_monotone_in_the_cap():
    """The assumption fails here (no expandable segments). 77 MiB on stream 0, freed: a cached 78 MiB
    segment. 32 MiB on stream 1: a new segment (110 MiB). 24 MiB on stream 0. 40 MiB on stream 1.
    - Cap 96-108 MiB: stream 1's 32 MiB does not fit beside the cached 78 (110 > cap): the release frees it,
      the retry fits; 24 MiB gets its own segment (56), 40 MiB too (96 <= cap). Survives.
    - Cap 110-148 MiB: nothing is released; 24 MiB splits the cached 78 MiB segment, pinning it; 40 MiB on
      stream 1 needs 150 MiB, the release finds no whole free segment: OOM.
    - Cap 150 MiB and more: survives. The bisection, from 150 MiB (the uncapped demand) down, meets only
      failing caps and answers 150 MiB: a boundary (2 MiB less fails), not the smallest cap."""
    events = _events(("a", 0, 77, 0), ("f", 0), ("a", 1, 32, 1), ("a", 2, 24, 0), ("a", 3, 40, 1))
    survival = _survival_by_cap(events, False, CapKind.FRACTION)
    assert [2 * k for k, ok in enumerate(survival[:75]) if ok] == list(range(96, 110, 2)) and all(survival[75:])
    assert smallest_surviving_cap(events, False) == 150 * MiB


# -- recorded traces -------------------------------------------------------------------------------------------

def test_events_from_a_snapshot():
    """[Note: Replaying a recorded trace]: ``alloc`` allocates (the size asked for), ``free_completed`` frees
    the latest allocation at its address (reused addresses get new keys), ``free_requested``, segment
    actions, ``oom`` and private pools are skipped, and a free of an address allocated before the trace
    began is dropped."""
    trace = [
        {"action": "segment_alloc", "addr": 0x1000, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 3 * MiB + 5, "stream": 0},
        {"action": "alloc", "addr": 0x9000, "size": 100, "stream": 7, "pool_id": (0, 0)},
        {"action": "free_requested", "addr": 0x1000, "size": 3 * MiB + 5, "stream": 0},
        {"action": "free_completed", "addr": 0x1000, "size": 3 * MiB + 5, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 4 * MiB, "stream": 0},
        {"action": "free_completed", "addr": 0x5000, "size": 8, "stream": 0},  # allocated before the trace
        {"action": "alloc", "addr": 0x7000, "size": 64, "stream": 0, "pool_id": (1, 0)},  # a CUDA graph's pool
        {"action": "oom", "size": 10 * MiB, "stream": 0, "device_free": 0},
    ]
    events = events_from_snapshot({"segments": [], "device_traces": [[], trace]}, device=1)
    assert events == [AllocEvent(ALLOC, 0, 3 * MiB + 5, 0), AllocEvent(ALLOC, 1, 100, 7),
                      AllocEvent(FREE, 0, 3 * MiB + 5, 0), AllocEvent(ALLOC, 3, 4 * MiB, 0)]
    stats = replay(events)
    assert (stats.allocated_bytes, stats.reserved_bytes) == (4 * MiB + 512, 22 * MiB)
    # a trace recorded without free_completed frees at free_requested
    requested_only = [e for e in trace if e["action"] != "free_completed"]
    assert [e.action for e in events_from_trace(requested_only)] == [ALLOC, ALLOC, FREE, ALLOC]


# -- the memory walk's accountant -------------------------------------------------------------------------------

D, C, R = Stream.DEFAULT, Stream.COPY_IN, Stream.REDUCE_SCATTER


def _two_layer_walk(acc):
    """A hand-made walk: the overhead, sharded state, then per layer an all-gather output on the copy-in
    stream, the unsharded parameters on the default stream, a mark with 2.5 MiB of temporaries, and
    finally a reduce-scatter mark with a 4 MiB comm buffer on its stream."""
    acc.on_alloc(Kind.OVERHEAD, 1e9, "", D)
    acc.on_alloc(Kind.SHARDED_PARAMS, 3 * MiB + 0.25, "", D)
    for layer in ("layers.0", "layers.1"):
        acc.on_alloc(Kind.ALL_GATHER_OUTPUT, 16 * MiB, layer, C)
        acc.on_alloc(Kind.UNSHARDED_PARAMS, 16.0 * MiB, layer, D)
        acc.on_free(Kind.ALL_GATHER_OUTPUT, 16 * MiB, layer, C)
        acc.on_mark("", layer, Phase.FORWARD, 2.5 * MiB, 0.0, D)
        acc.on_free(Kind.UNSHARDED_PARAMS, 16.0 * MiB, layer, D)
    acc.on_mark("reduce-scatter", "layers.1", Phase.BACKWARD, 0.0, 4 * MiB, R)


def test_the_accountant_drives_the_allocator():
    """[Note: From walk events to allocator calls] on _two_layer_walk. The overhead is outside the
    allocator. 3 MiB + 0.25 B -> 3 MiB + 1 B -> 3 MiB + 512: a 20 MiB segment, 17 MiB - 512 left. The
    all-gather output: a 16 MiB segment of the copy-in stream. The unsharded 16 MiB take the 17 MiB - 512
    block whole (less than 1 MiB would remain). The mark's temporaries: a new 20 MiB segment (56 MiB),
    freed after the mark. Layer 1 reuses all three (the copy-in block by the copy-in stream only). The
    reduce-scatter buffer: a 20 MiB segment of its stream, 76 MiB. Peak allocated: 36 MiB, before the
    first all-gather output is freed. The same as replaying the equivalent events."""
    acc = AllocatorAccountant(timeline=True)
    _two_layer_walk(acc)
    stats = acc.stats()
    assert acc.outside_bytes == 1e9 and stats.survived and acc.num_split_frees == 0
    assert (stats.reserved_bytes, stats.peak_reserved_bytes) == (76 * MiB, 76 * MiB)
    assert (stats.allocated_bytes, stats.peak_allocated_bytes) == (3 * MiB + 512, 36 * MiB)
    assert [(what, who, a / MiB, r / MiB) for what, who, _, a, r in acc.marks] == [
        ("", "layers.0", 22.5, 56), ("", "layers.1", 22.5, 56), ("reduce-scatter", "layers.1", 7 + 512 / MiB, 76)]
    assert sorted((s.stream, s.total_bytes // MiB) for s in acc.allocator.segments()) == [
        (D, 20), (D, 20), (C, 16), (R, 20)]
    events = _events(("a", "sharded", (3 * MiB + 1) / MiB, D))
    for i in range(2):
        events += _events(("a", f"ag{i}", 16, C), ("a", f"p{i}", 16, D), ("f", f"ag{i}"), ("a", f"t{i}", 2.5, D),
                          ("f", f"t{i}"), ("f", f"p{i}"))
    events += _events(("a", "rs", 4, R), ("f", "rs"))
    assert replay(events) == stats


def test_the_accountant_frees_the_latest_matching_allocation():
    """Two 12 MiB allocations alike (each its own segment): a free releases the later one."""
    acc = AllocatorAccountant()
    for _ in range(2):
        acc.on_alloc(Kind.ACTIVATIONS, 12 * MiB, "", D)
    acc.on_free(Kind.ACTIVATIONS, 12 * MiB, "", D)
    assert [s.allocated_bytes // MiB for s in acc.allocator.segments()] == [12, 0]
    acc.on_alloc(Kind.TEMPORARIES, 0.4, "x", D)  # rounds up to 1 B: a 512 B block
    acc.on_alloc(Kind.TEMPORARIES, 0.0, "x", D)  # nothing
    acc.on_free(Kind.TEMPORARIES, 0.0, "x", D)
    assert acc.allocator.allocated_bytes == 12 * MiB + 512 and acc.allocator.requested_bytes == 12 * MiB + 1


def test_frees_that_match_no_allocation_take_bytes_newest_first():
    """[Note: Frees that match no allocation]: gradients allocated per block (12 MiB for b0, then b1), freed
    per unit: 20 MiB takes b1's whole and 8 MiB of b0's (b0 freed, 4 MiB allocated again), then the last
    4 MiB; freeing more than is live raises."""
    acc = AllocatorAccountant()
    acc.on_alloc(Kind.GRADS, 12 * MiB, "b0", D)
    acc.on_alloc(Kind.GRADS, 12 * MiB, "b1", D)
    acc.on_free(Kind.GRADS, 20 * MiB, "unit", D)
    assert acc.allocator.allocated_bytes == 4 * MiB and acc.num_split_frees == 1
    assert [s.blocks for s in acc.allocator.segments()] == [((4 * MiB, True), (8 * MiB, False)), ((12 * MiB, False),)]
    acc.on_free(Kind.GRADS, 4 * MiB, "unit", D)
    assert acc.allocator.allocated_bytes == 0 and acc.num_split_frees == 2
    with pytest.raises(ValueError):
        acc.on_free(Kind.GRADS, 1 * MiB, "unit", D)


def test_the_accountant_stops_at_the_oom():
    """Cap 30 MiB: a 16 MiB segment, then another would make 32 MiB; nothing cached to release: OOM. Later
    events are ignored and the next mark is named."""
    acc = AllocatorAccountant(AllocatorConfig(cap_bytes=30 * MiB))
    acc.on_alloc(Kind.UNSHARDED_PARAMS, 16 * MiB, "layers.0", D)
    acc.on_alloc(Kind.UNSHARDED_PARAMS, 16 * MiB, "layers.1", D)
    acc.on_free(Kind.GRADS, 99 * MiB, "nothing", D)  # ignored after the OOM
    acc.on_mark("", "layers.1", Phase.FORWARD, 0.0, 0.0, D)
    acc.on_mark("", "layers.2", Phase.FORWARD, 0.0, 0.0, D)
    stats = acc.stats()
    assert not stats.survived and (stats.num_ooms, stats.num_alloc_retries) == (1, 1)
    assert stats.oom.request_bytes == 16 * MiB and acc.oom_mark == ("", "layers.1", Phase.FORWARD)
