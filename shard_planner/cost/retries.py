"""The price of the CUDA caching allocator's retries: what a step that survives --mem only by releasing the
allocator's cache loses to it (issue 29, build item 3: "plans that only fit with retries say so and price
them"). The one place a retry becomes seconds; cost/fits.py attaches the price to a plan's verdict.

    price = price_retries(capped, time, profile)   # RetryPrice; no_retries(step) when the step does not retry
    price.total_s = price.sync_s + price.free_s + price.alloc_s
    price.describe()                                # 'costing 12.3 ms per step (+1.2%): ...'

[Note: How retries are priced]
  What a retry does (c10/cuda/CUDACachingAllocator.cpp, torch 2.13; cost/allocator.py [Note: Release and
  retry, then out of memory]): ``release_cached_blocks`` first ``synchronize_and_free_events``, then
  ``cudaFree`` of every whole free segment, which "waits for all operations on the GPU to finish"
  (colesbury, pytorch#19222); with expandable segments ``unmapHandles`` calls ``cudaStreamSynchronize`` and
  then ``cuMemUnmap`` + ``cuMemRelease`` per page (cost/allocator_expandable.py [Note: One driver call per
  page]). What it released, the step allocates again later: ``cudaMalloc`` per segment, or ``cuMemCreate`` +
  ``cuMemMap`` per page. The simulation counts each (cost/reserved.py [Note: What a retry of the second
  step costs the allocator]); the price per step is three terms:
  - ``sync_s``, the device synchronisation. Until it, the host runs ahead of the GPU and FSDP2's collectives
    run on their own streams beside the compute (cost/time.py); at it, every stream drains and the host
    issues nothing, so the streams are serialised at that point: the collective in flight there no longer
    hides behind compute. The model: each retry exposes one collective, bounded by the step's longest
    (the largest of any unit's all-gather or reduce-scatter time; the retry usually fails in the next
    unit's all-gather buffer), and all the retries of a step together at most the communication the
    step hid (``comm_s - exposed_comm_s``): ``min(retries x longest, hidden)``. A bound, not a mean: the
    collective in flight may be shorter, and the compute queued before the sync still runs. The kernel
    launches after the sync (the host refilling the queue) are microseconds (the profile's
    ``per_op_overhead_s``) and are left out.
  - ``free_s``: ``cudaFree`` calls x the profile's ``cuda_free_s``, or pages unmapped x ``page_unmap_s``.
  - ``alloc_s``: the driver allocations the retries force (``forced_alloc_calls_per_step``) x
    ``cuda_malloc_s``, or pages mapped x ``page_map_s``.
  The four per-call times are the GPU profiles' (shard_planner/hardware/profile.py), each with its source in the
  profile: published figures give ranges only (about 50 us per ``cudaMalloc`` up to 512 KB, rising with the
  size beyond: M. Boyer, "Memory allocation overhead", cs.virginia.edu/~mwb7w/cuda_support/
  memory_management_overhead.html; pytorch#172056 finds ``cuMemCreate`` / ``cuMemUnmap`` / ``cuMemRelease``
  the bulk of an expandable allocation's API time at 20 MiB pages), so the profiles state values marked
  ESTIMATE, and ``calibrate`` writes the same ones (not measured). What checks them: the cap sweep of
  benchmarks/gpu_allocator.py (run by benchmarks/gpu_check.sh) records step time and ``num_alloc_retries``
  at caps below the memory without retries; the step time there less the one without retries, per retry,
  is the measured price to set these against, and the sync bound against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.cost.reserved import ReservedEstimate
from shard_planner.cost.types import TimeEstimate
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.units import format_bytes

# The per-call times the GPU profiles state (profiles/*.toml, each line with its source) and `calibrate` writes
# for a GPU, which does not measure them: [Note: How retries are priced]
STATED_CALL_S = {"cuda_malloc_s": 5e-4, "cuda_free_s": 5e-4, "page_map_s": 5e-5, "page_unmap_s": 5e-5}


@dataclass(frozen=True)
class RetryPrice:
    """The retries of one step and what they cost it (seconds); [Note: How retries are priced]."""

    retries_per_step: int
    expandable_segments: bool
    free_calls_per_step: int  # cudaFree calls, or pages unmapped
    freed_bytes_per_step: int
    forced_alloc_calls_per_step: int  # cudaMalloc calls, or pages mapped
    sync_s: float
    free_s: float
    alloc_s: float
    step_time_s: float  # the step's predicted time without the retries

    @property
    def total_s(self) -> float:
        return self.sync_s + self.free_s + self.alloc_s

    @property
    def share(self) -> float:
        """The retries' time over the step's without them: 0.012 is +1.2%."""
        return self.total_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def describe(self) -> str:
        """'costing 12.3 ms per step (+1.2%: synchronisation 10 ms, 40 cudaFree of 3.10 GiB 2 ms, 40 cudaMalloc
        again 0.3 ms)'."""
        free, alloc = ("page unmaps", "page maps") if self.expandable_segments else ("cudaFree", "cudaMalloc")
        return (f"costing {self.total_s * 1e3:.3g} ms per step ({100 * self.share:+.2g}%: synchronisation "
                f"{self.sync_s * 1e3:.3g} ms, {self.free_calls_per_step} {free} of "
                f"{format_bytes(self.freed_bytes_per_step)} {self.free_s * 1e3:.3g} ms, "
                f"{self.forced_alloc_calls_per_step} {alloc} again {self.alloc_s * 1e3:.3g} ms)")


def no_retries(step_time_s: float) -> RetryPrice:
    """The price of a step without retries: zero."""
    return RetryPrice(0, False, 0, 0, 0, 0.0, 0.0, 0.0, step_time_s)


def sync_exposed_s(time: TimeEstimate, retries: int) -> float:
    """The communication ``retries`` device synchronisations expose in a step: one collective each, at most
    the step's longest, and at most what the step hid in all ([Note: How retries are priced])."""
    longest_s = max((max(u.all_gather_s, u.reduce_scatter_s) for u in time.units), default=0.0)
    hidden_s = max(0.0, time.comm_s - time.exposed_comm_s)
    return min(retries * longest_s, hidden_s)


def price_retries(capped: ReservedEstimate, time: TimeEstimate, profile: HardwareProfile) -> RetryPrice:
    """What the retries per step of ``capped`` (the allocator under --mem, cost/reserved.py) cost a step of
    ``time`` on ``profile``'s device; zero when it does not retry or runs out of memory (no step to price)."""
    if capped.retries_per_step == 0 or capped.oom_at is not None:
        return no_retries(time.step_time_s)
    expandable = capped.expandable_segments
    free_calls = sum(r.free_calls for r in capped.step_retries)
    per_free_s, per_alloc_s = ((profile.page_unmap_s, profile.page_map_s) if expandable
                               else (profile.cuda_free_s, profile.cuda_malloc_s))
    return RetryPrice(
        retries_per_step=capped.retries_per_step, expandable_segments=expandable, free_calls_per_step=free_calls,
        freed_bytes_per_step=sum(r.freed_bytes for r in capped.step_retries),
        forced_alloc_calls_per_step=capped.forced_alloc_calls_per_step,
        sync_s=sync_exposed_s(time, capped.retries_per_step), free_s=free_calls * per_free_s,
        alloc_s=capped.forced_alloc_calls_per_step * per_alloc_s, step_time_s=time.step_time_s)
