"""Replaying allocation events through the caching-allocator simulation (cost/allocator.py).

    replay(events, AllocatorConfig(...)) -> AllocatorStats          # stops at the first OOM (stats.oom)
    smallest_surviving_cap(events, expandable_segments) -> int       # bytes, a multiple of 2 MiB
    events_from_snapshot(torch.cuda.memory._snapshot(), device=0) -> list[AllocEvent]
    events_from_trace(snapshot["device_traces"][0]) -> list[AllocEvent]

An event is ``AllocEvent(action, key, size_bytes, stream)``: ``Action.ALLOC`` allocates ``size_bytes`` on
``stream`` under ``key`` (any hashable, unique among live allocations), ``Action.FREE`` frees the live
allocation of that ``key`` (its size is not read). A 0-byte allocation does not reach the allocator and
is skipped, its free too.

[Note: Replaying a recorded trace]
  With ``torch.cuda.memory._record_memory_history()`` the allocator records a ``TraceEntry`` per action
  (``record_trace``): ``alloc`` at the end of ``alloc_found_block`` with the size asked for (``orig_size``,
  before rounding), the block's address and stream; ``free_requested`` when ``free`` is called and
  ``free_completed`` when the block returns to the pool (``free_block``; later than the request only
  after ``record_stream``); and segment actions (``segment_alloc``, ``segment_free``, ``segment_map``,
  ``segment_unmap``), ``oom`` and ``snapshot``, which are the allocator's own decisions and which a replay
  re-derives rather than reads. The converter turns ``alloc`` into ALLOC and ``free_completed`` into FREE
  (``free_requested`` when the trace has no ``free_completed``, as when recorded with
  ``skip_actions=["free_completed"]``). An address is reused once freed, so each ``alloc`` gets a new key
  and a free goes to the latest allocation at its address. The trace is a ring buffer that may start after
  some allocations were made: a free of an address it never saw allocated is dropped, and the replay
  misses what those allocations held. Entries of a private pool (``pool_id`` other than (0, 0): CUDA graphs,
  ``torch.cuda.MemPool``) are skipped: the simulation models the default pools only.

[Note: The smallest cap, by bisection]
  Whether a replay survives a cap changes only at multiples of 2 MiB: the cap is compared with reserved
  bytes plus a segment size or plus pages (``alloc_block``, ``map_block``), all multiples of 2 MiB
  (``kSmallBuffer``, ``kRoundLarge``, ``kLargeBuffer``). Above a known cap nothing changes: when no segment
  is refused, a capped run is the uncapped one, so every cap from the uncapped replay's
  ``peak_cap_demand_bytes`` up (for the device's memory: its ``peak_reserved_bytes``) survives, with no
  retry. And a cap more than one 20 MiB page below the peak of the bytes requested fails (reserved >=
  allocated >= requested, and reserved passes the cap by less than a page). Between the two the search
  bisects over multiples of 2 MiB, assuming survival is monotone in the cap.
  The allocator does not promise that, and random sequences break it about one time in twenty: a lower cap
  releases the caches earlier, and what is cached decides which blocks get split and pinned later.
  tests/cost/test_allocator.py has a four-allocation case that survives 96-108 MiB, fails 110-148 MiB and
  survives from 150 MiB: a block freed on stream 0 stays cached under a large cap, a later request on
  stream 0 splits it (its remainder is pinned: a segment is released only whole), and stream 1 then runs
  out; under a small cap the retry of stream 1's first request had released it. What the bisection
  promises is a boundary: the replay survives the cap returned and fails 2 MiB below it; when survival is
  monotone it is the smallest cap. To know whether a run survives a given device, replay at that cap.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import replace
from typing import NamedTuple

from shard_planner.cost.allocator import (
    K_LARGE_BUFFER, MiB, AllocatorConfig, AllocatorOutOfMemory, AllocatorStats, CachingAllocator,
)

CAP_GRAIN_BYTES = 2 * MiB  # [Note: The smallest cap, by bisection]


class Action(enum.Enum):
    ALLOC = "alloc"
    FREE = "free"


ALLOC, FREE = Action.ALLOC, Action.FREE


class AllocEvent(NamedTuple):
    """One allocation or free; see the module docstring."""

    action: Action
    key: Hashable
    size_bytes: int
    stream: int = 0


class CapKind(enum.Enum):
    """Which limit :func:`smallest_surviving_cap` searches: the cap of ``set_per_process_memory_fraction``
    (``AllocatorConfig.cap_bytes``) or the device's memory (``AllocatorConfig.device_bytes``)."""

    FRACTION = "cap_bytes"
    DEVICE = "device_bytes"


def replay(events: Iterable[AllocEvent], config: AllocatorConfig = AllocatorConfig()) -> AllocatorStats:
    """The allocator's statistics after ``events``; at the first OOM the replay stops, and ``stats.oom``
    says which event failed (``event_index``) and the state then."""
    allocator = CachingAllocator(config)
    malloc, free = allocator.malloc, allocator.free
    handles: dict = {}
    for i, (action, key, size_bytes, stream) in enumerate(events):
        if action is ALLOC:
            if key in handles:
                raise ValueError(f"event {i}: key {key!r} is already allocated")
            if size_bytes <= 0:
                handles[key] = None
                continue
            try:
                handles[key] = malloc(size_bytes, stream)
            except AllocatorOutOfMemory as oom:
                return allocator.stats(replace(oom.report, event_index=i))
        else:
            try:
                handle = handles.pop(key)
            except KeyError:
                raise ValueError(f"event {i}: free of {key!r}, which is not allocated") from None
            if handle is not None:
                free(handle)
    return allocator.stats()


def smallest_surviving_cap(events: Iterable[AllocEvent], expandable_segments: bool,
                           limit: CapKind = CapKind.FRACTION) -> int:
    """The smallest cap in bytes (a multiple of 2 MiB) at which :func:`replay` of ``events`` completes
    without an OOM, found by bisection; ``limit`` says which limit it caps. Exact when survival is monotone
    in the cap; otherwise a cap that survives with 2 MiB less failing. See [Note: The smallest cap, by
    bisection]."""
    events = list(events)
    base = AllocatorConfig(expandable_segments=expandable_segments)
    uncapped = replay(events, base)
    if uncapped.peak_reserved_bytes == 0:
        return 0

    def survives(k: int) -> bool:
        return replay(events, replace(base, **{limit.value: k * CAP_GRAIN_BYTES})).survived

    no_refusal_bytes = uncapped.peak_cap_demand_bytes if limit is CapKind.FRACTION else uncapped.peak_reserved_bytes
    hi = -(-no_refusal_bytes // CAP_GRAIN_BYTES)  # survives: the uncapped run
    lo = max(-1, (uncapped.peak_requested_bytes - K_LARGE_BUFFER) // CAP_GRAIN_BYTES - 1)  # fails
    while hi - lo > 1:  # invariant: lo fails (-1: no cap below 0), hi survives
        mid = (lo + hi) // 2
        if survives(mid):
            hi = mid
        else:
            lo = mid
    return hi * CAP_GRAIN_BYTES


def events_from_snapshot(snapshot: Mapping, device: int = 0) -> list[AllocEvent]:
    """The allocation events of one device of a ``torch.cuda.memory._snapshot()`` dict (its
    ``device_traces``); see [Note: Replaying a recorded trace]."""
    return events_from_trace(snapshot["device_traces"][device])


def events_from_trace(trace: Iterable[Mapping]) -> list[AllocEvent]:
    """One device's ``TraceEntry`` dicts (``action``, ``addr``, ``size``, ``stream``, ``pool_id``) as
    allocation events; see [Note: Replaying a recorded trace]."""
    trace = [e for e in trace if tuple(e.get("pool_id", (0, 0))) == (0, 0)]
    free_action = "free_completed" if any(e["action"] == "free_completed" for e in trace) else "free_requested"
    events: list[AllocEvent] = []
    key_at: dict[int, int] = {}  # address -> key of the live allocation there
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            key = len(events)
            key_at[entry["addr"]] = key
            events.append(AllocEvent(ALLOC, key, int(entry["size"]), int(entry["stream"])))
        elif action == free_action:
            key = key_at.pop(entry["addr"], None)
            if key is not None:
                events.append(AllocEvent(FREE, key, int(entry["size"]), int(entry["stream"])))
    return events
