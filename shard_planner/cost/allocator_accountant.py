"""The caching-allocator simulation (cost/allocator.py) as an accountant of the memory walk's events.

cost/memory.py emits every allocation and free it models to an accountant (cost/allocations.py,
``Accountant``); :class:`AllocatorAccountant` passes them to a :class:`CachingAllocator`, so a walk gives
the reserved bytes beside the allocated ones, the retries and the OOM under a cap:

    accountant = AllocatorAccountant(AllocatorConfig(expandable_segments=True, device_bytes=...))
    simulate_memory_walk(..., accountants=(accountant,))
    accountant.stats() -> AllocatorStats          # peak_reserved_bytes, num_alloc_retries, oom
    accountant.oom_mark                           # (what, who, phase) of the first mark at or after the OOM

[Note: From walk events to allocator calls]
  - Sizes come as floats (bytes computed from shapes and ratios); each is rounded up to whole bytes, and a
    size that rounds to 0 allocates nothing (``allocate`` never calls the allocator for 0 bytes).
  - A free goes to the latest live allocation with the same (kind, bytes, owner, stream): last in, first
    out, the way the walk frees a unit's buffers after allocating them.
  - A mark's scratch (cost/allocations.py: ``temp_bytes`` then ``comm_bytes``, on the mark's stream) is
    allocated just before the moment and freed just after it, in reverse order.
  - Each ``Stream`` is its own simulated stream, so a block freed by the reduce-scatter stream is not reused
    by the default stream (cost/allocator_blocks.py [Note: Best fit per stream]).
  - ``Kind.OVERHEAD`` (the profile's reserved bytes: the CUDA context, NCCL's buffers, the memory of each
    process group) is not the caching allocator's: NCCL and the CUDA runtime allocate outside it. Those
    bytes are counted in ``outside_bytes`` and not simulated; the device memory the allocator can get
    (``AllocatorConfig.device_bytes``) is the GPU's less them.
  - At the first OOM the accountant stops: the program would have stopped there. ``stats().oom`` is the
    allocator's report; later events are ignored.
  With ``timeline=True`` it keeps, per mark, (what, who, phase, allocated bytes, reserved bytes) at the
  moment (scratch included), for the report's timeline of reserved beside allocated memory. With
  ``record=True`` it keeps every call it made to the allocator as ``events`` (cost/allocator_replay.py
  ``AllocEvent``s, the stream as its number), to replay under other limits (benchmarks/gpu_allocator.py).

[Note: Frees that match no allocation]
  The walk does not always free what it allocated, one for one: gradients are allocated per block (owner:
  the block) and freed per unit after the reduce-scatter copy-in, as the unit's sum less the gradient
  autograd produced last, which is freed after the collective (cost/memory.py ``reduce_scatter``). Such a
  free takes bytes from the live allocations of its kind and stream, newest first, those of its owner
  before the others: whole allocations while they fit, and of the last one the part freed, the rest
  allocated again at once (free, then allocate). The bytes live then equal the walk's, but the blocks are
  the walk's aggregates, not FSDP2's tensors: the simulated layout of gradients is an approximation until
  the walk emits one event per tensor. ``num_split_frees`` counts the frees that took this path; a free of
  more bytes than are live (beyond a rounding slack of ``_SLACK_BYTES``) raises.
"""

from __future__ import annotations

from shard_planner.cost.allocations import OVERHEAD, Kind, Stream
from shard_planner.cost.allocator import AllocatorConfig, AllocatorOutOfMemory, AllocatorStats, CachingAllocator
from shard_planner.cost.allocator_replay import ALLOC, FREE, AllocEvent
from shard_planner.cost.schedule import Phase

_SLACK_BYTES = 64  # a sum of float sizes rounded piece by piece may differ by a few bytes from the whole


def _whole_bytes(size_bytes: float) -> int:
    """``size_bytes`` rounded up to whole bytes (an int stays itself)."""
    n = int(size_bytes)
    return n + 1 if n < size_bytes else n


class _Live:
    """One live allocation: its allocator handle (None for 0 bytes), bytes and owner."""

    __slots__ = ("handle", "size", "owner", "alive")

    def __init__(self, handle: int | None, size: int, owner: str):
        self.handle, self.size, self.owner, self.alive = handle, size, owner, True


class AllocatorAccountant:
    """An accountant (cost/allocations.py ``Accountant``) that simulates the caching allocator. See
    [Note: From walk events to allocator calls]."""

    def __init__(self, config: AllocatorConfig = AllocatorConfig(), timeline: bool = False, record: bool = False):
        self.allocator = CachingAllocator(config)
        self._malloc, self._free = self.allocator.malloc, self.allocator.free
        self.events: list[AllocEvent] | None = None
        if record:
            self._record()
        self._by_key: dict[tuple, list[_Live]] = {}  # (kind, bytes, owner, stream) -> live, newest last
        self._by_kind: dict[tuple, list[_Live]] = {}  # (kind, stream) -> live (and some freed), newest last
        self.oom = None  # the OomReport of the first OOM
        self.oom_mark: tuple | None = None  # (what, who, phase) of the first mark at or after it
        self.num_split_frees = 0
        self.outside_bytes = 0.0  # live Kind.OVERHEAD bytes: outside the allocator
        self.marks: list[tuple] | None = [] if timeline else None

    def _record(self) -> None:
        """Keep every malloc and free as an ``AllocEvent`` in ``events`` (a handle's key: its malloc's index)."""
        malloc, free, events, keys = self._malloc, self._free, [], {}

        def recorded_malloc(size: int, stream: Stream) -> int:
            handle = malloc(size, stream)
            keys[handle] = len(events)
            events.append(AllocEvent(ALLOC, len(events), size, int(stream)))
            return handle

        def recorded_free(handle: int) -> None:
            free(handle)
            events.append(AllocEvent(FREE, keys.pop(handle), 0, 0))

        self.events, self._malloc, self._free = events, recorded_malloc, recorded_free

    def stats(self) -> AllocatorStats:
        return self.allocator.stats(self.oom)

    def on_alloc(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        if kind is OVERHEAD:
            self.outside_bytes += size_bytes
        elif self.oom is None:
            self._alloc(kind, _whole_bytes(size_bytes), owner, stream)

    def on_free(self, kind: Kind, size_bytes: float, owner: str, stream: Stream) -> None:
        if kind is OVERHEAD:
            self.outside_bytes -= size_bytes
            return
        if self.oom is not None:
            return
        size = _whole_bytes(size_bytes)
        stack = self._by_key.get((kind, size, owner, stream))
        if stack:
            self._release(stack.pop())
            by_kind = self._by_kind[kind, stream]
            while by_kind and not by_kind[-1].alive:
                by_kind.pop()
        elif size > 0:
            self._free_unmatched(kind, size, owner, stream)

    def on_mark(self, what: str, who: str, phase: Phase, temp_bytes: float, comm_bytes: float,
                stream: Stream) -> None:
        if self.oom is not None:
            if self.oom_mark is None:
                self.oom_mark = (what, who, phase)
            return
        handles = []
        for nbytes in (temp_bytes, comm_bytes):
            size = _whole_bytes(nbytes) if nbytes else 0
            if size > 0:
                try:
                    handles.append(self._malloc(size, stream))
                except AllocatorOutOfMemory as oom:
                    self.oom, self.oom_mark = oom.report, (what, who, phase)
                    return
        if self.marks is not None:
            self.marks.append((what, who, phase, self.allocator.allocated_bytes, self.allocator.reserved_bytes))
        for handle in reversed(handles):
            self._free(handle)

    def _alloc(self, kind: Kind, size: int, owner: str, stream: Stream) -> None:
        handle = None
        if size > 0:
            try:
                handle = self._malloc(size, stream)
            except AllocatorOutOfMemory as oom:
                self.oom = oom.report
                return
        live = _Live(handle, size, owner)
        key = (kind, size, owner, stream)
        stack = self._by_key.get(key)
        if stack is None:
            self._by_key[key] = [live]
        else:
            stack.append(live)
        by_kind = self._by_kind.get((kind, stream))
        if by_kind is None:
            self._by_kind[kind, stream] = [live]
        else:
            by_kind.append(live)

    def _release(self, live: _Live) -> None:
        live.alive = False
        if live.handle is not None:
            self._free(live.handle)

    def _free_unmatched(self, kind: Kind, size: int, owner: str, stream: Stream) -> None:
        """[Note: Frees that match no allocation]."""
        self.num_split_frees += 1
        newest_first = [live for live in reversed(self._by_kind.get((kind, stream), ())) if live.alive]
        remaining = size
        for live in [x for x in newest_first if x.owner == owner] + [x for x in newest_first if x.owner != owner]:
            if remaining <= _SLACK_BYTES:
                break
            self._by_key[kind, live.size, live.owner, stream].remove(live)
            self._release(live)
            if live.size - remaining > _SLACK_BYTES:  # the part freed; the rest stays allocated
                self._alloc(kind, live.size - remaining, live.owner, stream)
                if self.oom is not None:
                    return
            remaining -= live.size
        if remaining > _SLACK_BYTES:
            raise ValueError(f"free of {size} B of {kind.name} owned by {owner!r} on stream {stream.name}: only "
                             f"{size - remaining} B of that kind are live on that stream")
