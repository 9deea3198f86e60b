"""A simulation of PyTorch's CUDA caching allocator: what a sequence of allocations and frees reserves.

The planner's memory walk predicts the bytes allocated; a GPU runs out of memory when the allocator
cannot *reserve* what it needs. The allocator (c10/cuda/CUDACachingAllocator.cpp, class
``DeviceCachingAllocator``; torch 2.13) is deterministic given the order of ``malloc`` and ``free`` calls
and their streams, and this module replays its rules in Python:

    allocator = CachingAllocator(AllocatorConfig(expandable_segments=True, cap_bytes=40 * GiB))
    handle = allocator.malloc(size_bytes, stream)     # raises AllocatorOutOfMemory
    allocator.free(handle)
    allocator.reserved_bytes, allocator.peak_reserved_bytes, allocator.num_alloc_retries, allocator.stats()
    allocator.segments()                              # the segments and their blocks, per stream

cost/allocator_replay.py replays event lists and recorded ``torch.cuda.memory._snapshot()`` traces and
finds the smallest cap a sequence survives; cost/allocator_accountant.py drives the simulation from the
memory walk's allocation events (cost/allocations.py). The blocks and their pools are in
cost/allocator_blocks.py, expandable segments in cost/allocator_expandable.py. Every rule is a note
naming the function or constant of the source it follows; what is not modelled is said in
[Note: What is not modelled].

[Note: The source read]
  The rules below were read in two copies of c10/cuda/CUDACachingAllocator.cpp that agree on every one of
  them: pytorch/pytorch at 001074d (before the allocator settings moved to c10/core/AllocatorConfig.h) and
  the ROCm/pytorch fork at 08b2238 (after: ``AcceleratorAllocatorConfig``, ``use_on_oom_pools``). The
  constants are torch 2.13's (its c10/core/AllocatorConfig.h). The 2.13 .cpp itself was not at hand.

[Note: Rounding and the two pools]
  ``round_size``: a request below ``kMinBlockSize`` (512 B) takes 512 B, any other rounds up to a multiple
  of 512 B (``roundup_power2_divisions``, unset by default, would round coarser). ``get_pool``: a rounded
  size up to ``kSmallSize`` (1 MiB) comes from the small pool, anything larger from the large pool; the
  pools never lend to each other. A request of 0 bytes never reaches the allocator (``allocate`` returns
  a null pointer), so :meth:`CachingAllocator.malloc` refuses it.

[Note: The size of a new segment]
  ``get_allocation_size``: a small request gets a ``kSmallBuffer`` (2 MiB) segment; a large one below
  ``kMinLargeAlloc`` (10 MiB) a ``kLargeBuffer`` (20 MiB) segment, split among later requests; one of
  10 MiB or more a segment of its own size rounded up to ``kRoundLarge`` (2 MiB): 9 MiB -> 20 MiB,
  10 MiB -> 10 MiB, 11 MiB -> 12 MiB. With expandable segments the same size is what the cap is checked
  against, but the memory comes in pages (cost/allocator_expandable.py).

[Note: When a block is split]
  ``should_split``: in the small pool, and in both pools with expandable segments, a block is split when
  at least ``kMinBlockSize`` (512 B) would remain; in the large pool of ``cudaMalloc`` segments only when
  more than ``kSmallSize`` (1 MiB) would remain (and the request is below ``max_split_size``, unlimited by
  default). An unsplit block is allocated whole: ``allocated_bytes`` counts the block, not the request.

[Note: The cap and the device's memory]
  ``alloc_block`` first refuses when ``set_fraction`` and ``total_allocated_memory + alloc_size >
  allowed_memory_maximum``: the reserved bytes plus the new segment's size (``get_allocation_size``)
  against the cap ``set_per_process_memory_fraction`` sets (``setMemoryFraction``: the fraction times the
  device's total memory) — ``cap_bytes`` here. Then it asks the device: ``cudaMalloc(alloc_size)``, or
  with expandable segments the pages to map, which fails when the device has less free memory —
  ``device_bytes`` here, the memory the allocator can get (the GPU's, less the CUDA context, NCCL and
  anything else outside it). With expandable segments the cap sees ``alloc_size``, not the pages mapped:
  extending a free block at the end of the segment may need no new page and still be refused, and an
  11 MiB request passes the check as 12 MiB and maps a 20 MiB page, so reserved can pass the cap by less
  than a page.

[Note: Release and retry, then out of memory]
  ``malloc``: a cached block (``get_free_block``; the free-memory callbacks, for CUDA IPC only, are not
  modelled), else a new segment (``alloc_block``); when that fails, ``release_available_cached_blocks``
  (a no-op while ``max_split_size`` is unlimited), then ``release_cached_blocks`` and ``alloc_block`` once
  more as a retry, which counts ``num_alloc_retries`` whether or not it succeeds. ``release_cached_blocks``
  empties the caches of every stream, the large pool then the small one (``release_blocks``): each free
  block that is a whole ``cudaMalloc`` segment (no ``prev``, no ``next``) is freed (``release_block``); a
  segment holding any allocation stays whole, its free blocks cached; with expandable segments the free
  pages are unmapped instead (cost/allocator_expandable.py [Note: Releasing expandable segments]). When
  the retry fails too, ``num_ooms`` counts it and ``OutOfMemoryError`` is raised: here
  :class:`AllocatorOutOfMemory`, carrying an :class:`OomReport`. The caches stay released, and the
  allocator stays usable, as after a caught OOM on the GPU. ``torch.cuda.empty_cache`` is the same
  release (:meth:`CachingAllocator.empty_cache`). Each retry is recorded as a :class:`RetryRelease`: the
  driver calls its release made (a ``cudaFree`` per segment, or a ``cuMemUnmap`` + ``cuMemRelease`` per
  page: cost/allocator_expandable.py [Note: One driver call per page]), the bytes released, and the
  allocator's driver allocations so far (``device_alloc_calls``), from which cost/reserved.py counts the
  allocations that follow it; cost/retries.py prices them.

[Note: Frees are immediate]
  ``free`` returns a block to its pool at once (``free_block``) unless the block was used on another
  stream (``record_stream``), when it waits for those streams' events (``insert_events`` /
  ``process_events``). FSDP2 synchronises its streams by hand and does not call ``record_stream``
  (cost/allocations.py [Note: Which stream allocates what]), so the simulation frees at once: the order
  of the calls on the host decides the state.

[Note: What is not modelled]
  The configuration's other settings at their defaults: ``max_split_size_mb`` (unlimited),
  ``max_non_split_rounding_mb``, ``roundup_power2_divisions`` (none), ``garbage_collection_threshold``
  (0: off), ``large_segment_size_mb`` (20 MiB), ``throw_on_cudamalloc_oom`` (off: no
  ``num_oom_rejections``); private pools (CUDA graphs, ``torch.cuda.MemPool``); ``record_stream`` events;
  the driver's addresses (cost/allocator_expandable.py [Note: Simulated addresses]; new ``cudaMalloc``
  segments here get increasing addresses, so of two free blocks of the same size in different segments
  the older segment's is taken, where on the GPU it depends on the addresses the driver returned).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from shard_planner.cost.allocator_blocks import (
    K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_BUFFER, K_SMALL_SIZE, MiB, Block,
    BlockPools,
)
from shard_planner.cost.allocator_expandable import ExpandableSegments

_CUDA_MALLOC_BASE = 1 << 32  # the simulated address of the first cudaMalloc segment


def round_size(size_bytes: int) -> int:
    """``round_size``: [Note: Rounding and the two pools]."""
    if size_bytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-size_bytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """``get_allocation_size`` of a rounded size: [Note: The size of a new segment]."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def should_split(block_size: int, size: int, small: bool, expandable: bool) -> bool:
    """``should_split``: [Note: When a block is split]."""
    remaining = block_size - size
    if small or expandable:
        return remaining >= K_MIN_BLOCK_SIZE
    return remaining > K_SMALL_SIZE


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator's settings. ``expandable_segments``: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
    ``cap_bytes``: the cap of ``torch.cuda.set_per_process_memory_fraction`` (fraction x the device's total
    memory; None: not set). ``device_bytes``: the device memory the allocator can get (None: unlimited).
    See [Note: The cap and the device's memory]."""

    expandable_segments: bool = False
    cap_bytes: int | None = None
    device_bytes: int | None = None

    def __post_init__(self):
        for name in ("cap_bytes", "device_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int of bytes or None, got {value!r}")


@dataclass(frozen=True)
class OomReport:
    """An allocation the allocator could not serve and its state then (after releasing its caches).
    ``event_index``: the failing event's position when a replay failed (None otherwise)."""

    request_bytes: int
    rounded_bytes: int
    segment_bytes: int  # alloc_size, what the error message says it "tried to allocate"
    stream: int
    allocated_bytes: int
    reserved_bytes: int
    cap_bytes: int | None
    device_bytes: int | None
    event_index: int | None = None

    def describe(self) -> str:
        limits = ", ".join(f"{name} {value / MiB:.1f} MiB" for name, value in
                           (("cap", self.cap_bytes), ("device", self.device_bytes)) if value is not None)
        return (f"out of memory allocating {self.request_bytes} B (a {self.segment_bytes / MiB:.1f} MiB segment) on "
                f"stream {self.stream}: {self.allocated_bytes / MiB:.1f} MiB allocated, "
                f"{self.reserved_bytes / MiB:.1f} MiB reserved" + (f" ({limits})" if limits else ""))


class RetryRelease(NamedTuple):
    """One ``release_cached_blocks`` of a retry: [Note: Release and retry, then out of memory]."""

    free_calls: int  # cudaFree calls (one per whole free segment) or page unmaps (expandable segments)
    freed_bytes: int  # the reserved bytes they returned to the driver
    alloc_calls_before: int  # the allocator's device_alloc_calls when the release began


class AllocatorOutOfMemory(MemoryError):
    """The simulated ``OutOfMemoryError``: [Note: Release and retry, then out of memory]."""

    def __init__(self, report: OomReport):
        super().__init__(report.describe())
        self.report = report


@dataclass(frozen=True)
class AllocatorStats:
    """The allocator's counters (``torch.cuda.memory_stats`` names): bytes now and at their peak, retries,
    OOMs, device calls (``cudaMalloc`` / map, ``cudaFree`` / unmap). ``peak_cap_demand_bytes``: in a run
    without a cap, the smallest ``cap_bytes`` that refuses no segment, above which a capped run is the
    uncapped one ([Note: The cap and the device's memory]). ``oom``: the OOM that ended a replay.
    ``device_alloc_calls`` / ``device_free_calls``: the driver calls (``cudaMalloc`` / ``cudaFree`` per
    segment, or per page mapped / unmapped with expandable segments); ``retry_releases``: each retry's
    release, in order."""

    allocated_bytes: int
    reserved_bytes: int
    requested_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int
    num_alloc_retries: int
    num_ooms: int
    num_device_alloc: int
    num_device_free: int
    peak_cap_demand_bytes: int  # the largest reserved + new segment alloc_block checked against a cap
    oom: OomReport | None = None
    device_alloc_calls: int = 0
    device_free_calls: int = 0
    retry_releases: tuple[RetryRelease, ...] = ()

    @property
    def survived(self) -> bool:
        return self.oom is None


@dataclass(frozen=True)
class SegmentView:
    """One segment (for an expandable segment: one contiguous mapped range, as ``memory_snapshot`` reports
    it): ``blocks`` as (size_bytes, allocated) in address order."""

    stream: int
    pool: str  # "small" | "large"
    address: int
    expandable: bool
    blocks: tuple[tuple[int, bool], ...]

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _ in self.blocks)

    @property
    def allocated_bytes(self) -> int:
        return sum(size for size, allocated in self.blocks if allocated)


class CachingAllocator:
    """The simulated ``DeviceCachingAllocator`` of one device. ``malloc`` returns a handle (the block's
    address) for ``free``; the counters are attributes (:class:`AllocatorStats` names)."""

    def __init__(self, config: AllocatorConfig = AllocatorConfig()):
        self.config = config
        self._pools = BlockPools()
        self._expandable = ExpandableSegments(self._pools) if config.expandable_segments else None
        self._live: dict[int, Block] = {}  # handle (address) -> allocated block
        self._next_addr = _CUDA_MALLOC_BASE
        self.allocated_bytes = self.reserved_bytes = self.requested_bytes = 0
        self.peak_allocated_bytes = self.peak_reserved_bytes = self.peak_requested_bytes = 0
        self.num_alloc_retries = self.num_ooms = self._num_malloc = self._num_free = 0
        self.peak_cap_demand_bytes = 0
        self.retry_releases: list[RetryRelease] = []

    @property
    def num_device_alloc(self) -> int:
        return self._num_malloc + (self._expandable.num_maps if self._expandable else 0)

    @property
    def num_device_free(self) -> int:
        return self._num_free + (self._expandable.num_unmaps if self._expandable else 0)

    @property
    def device_alloc_calls(self) -> int:
        """``cudaMalloc`` calls, or pages mapped (cost/allocator_expandable.py [Note: One driver call per page])."""
        return self._num_malloc + (self._expandable.pages_mapped if self._expandable else 0)

    @property
    def device_free_calls(self) -> int:
        """``cudaFree`` calls, or pages unmapped."""
        return self._num_free + (self._expandable.pages_unmapped if self._expandable else 0)

    def malloc(self, size_bytes: int, stream: int = 0) -> int:
        """Allocates ``size_bytes`` (> 0) on ``stream``; returns the handle. Raises
        :class:`AllocatorOutOfMemory`. See [Note: Release and retry, then out of memory]."""
        if size_bytes <= 0:
            raise ValueError(f"size_bytes must be positive (a 0-byte tensor does not reach the allocator), got "
                             f"{size_bytes}")
        size = round_size(size_bytes)
        small = size <= K_SMALL_SIZE
        expandable = self._expandable is not None
        block = self._pools.take_best_fit(small, stream, size, expandable)
        if block is None:
            block = self._alloc_block(small, stream, size)
            if block is None:
                free_calls, reserved = self.device_free_calls, self.reserved_bytes
                self.release_cached_blocks()
                self.retry_releases.append(RetryRelease(self.device_free_calls - free_calls,
                                                        reserved - self.reserved_bytes, self.device_alloc_calls))
                self.num_alloc_retries += 1
                block = self._alloc_block(small, stream, size)
                if block is None:
                    self.num_ooms += 1
                    raise AllocatorOutOfMemory(self._oom_report(size_bytes, size, stream))
        if should_split(block.size, size, small, expandable):
            block = self._pools.split(block, size)
        block.allocated = True
        block.requested = size_bytes
        self._live[block.addr] = block
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        self.requested_bytes += size_bytes
        if self.requested_bytes > self.peak_requested_bytes:
            self.peak_requested_bytes = self.requested_bytes
        return block.addr

    def free(self, handle: int) -> None:
        """Frees an allocation: its block goes back to its pool, merged with free neighbours."""
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(f"{handle:#x} is not a live allocation (freed twice, or never allocated)")
        block.allocated = False
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        self._pools.merge_neighbours(block)
        self._pools.insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: ``release_cached_blocks``."""
        self.release_cached_blocks()

    def release_cached_blocks(self) -> None:
        """Returns every whole cached segment to the device (with expandable segments: unmaps free pages),
        large pool first. See [Note: Release and retry, then out of memory]."""
        for small in (False, True):
            if self._expandable is not None:
                unmapped = self._expandable.release(small)
                self.reserved_bytes -= unmapped
                continue
            for block in self._pools.free_blocks(small):
                if not block.is_split():
                    self._pools.remove(block)
                    self.reserved_bytes -= block.size
                    self._num_free += 1

    def stats(self, oom: OomReport | None = None) -> AllocatorStats:
        return AllocatorStats(
            self.allocated_bytes, self.reserved_bytes, self.requested_bytes, self.peak_allocated_bytes,
            self.peak_reserved_bytes, self.peak_requested_bytes, self.num_alloc_retries, self.num_ooms,
            self.num_device_alloc, self.num_device_free, self.peak_cap_demand_bytes, oom,
            self.device_alloc_calls, self.device_free_calls, tuple(self.retry_releases))

    def segments(self, stream: int | None = None) -> tuple[SegmentView, ...]:
        """The segments (all streams, or one), ordered by (stream, address)."""
        blocks = list(self._live.values())
        for lst in self._pools.free.values():
            blocks.extend(entry[2] for entry in lst)
        heads = sorted((b for b in blocks if b.prev is None or not b.prev.mapped),
                       key=lambda b: (b.stream, b.addr))
        out = []
        for head in heads:
            if stream is not None and head.stream != stream:
                continue
            chain, b = [], head
            while b is not None and b.mapped:
                chain.append((b.size, b.allocated))
                b = b.next
            out.append(SegmentView(head.stream, "small" if head.small else "large", head.addr,
                                   head.segment is not None, tuple(chain)))
        return tuple(out)

    def _alloc_block(self, small: bool, stream: int, size: int) -> Block | None:
        """A new free block of at least ``size`` bytes, out of the pool, or None (``alloc_block``): the cap,
        then ``cudaMalloc`` or the expandable segment. See [Note: The cap and the device's memory]."""
        alloc_size = allocation_size(size)
        cap, device = self.config.cap_bytes, self.config.device_bytes
        demand = self.reserved_bytes + alloc_size
        if demand > self.peak_cap_demand_bytes:
            self.peak_cap_demand_bytes = demand
        if cap is not None and demand > cap:
            return None
        if self._expandable is not None:
            headroom = None if device is None else device - self.reserved_bytes
            block, mapped = self._expandable.try_allocate(small, stream, size, headroom)
            self._reserve(mapped)
            return block
        if device is not None and self.reserved_bytes + alloc_size > device:
            return None
        block = Block(self._next_addr, alloc_size, stream, small)
        self._next_addr += alloc_size
        self._num_malloc += 1
        self._reserve(alloc_size)
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes

    def _oom_report(self, size_bytes: int, size: int, stream: int) -> OomReport:
        return OomReport(size_bytes, size, allocation_size(size), stream, self.allocated_bytes,
                         self.reserved_bytes, self.config.cap_bytes, self.config.device_bytes)
