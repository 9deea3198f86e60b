"""Whether a plan fits a GPU of ``--mem``: its first two steps, simulated through the CUDA caching allocator,
survive the memory the allocator can get there (issue 29, build item 3).

    verdict = device_fit(cost_model, plan)    # FitVerdict; None on a CPU profile (no caching allocator)
    verdict.survives, verdict.retries_per_step, verdict.oom_at
    verdict.reserved_peak_total_bytes, verdict.no_retry_total_bytes    # the predictions, outside bytes included
    verdict.retry_price                                                # what the retries cost a step (cost/retries.py)
    verdict.priced(prediction)                                         # the plan's prediction, retries priced in
    verdict.describe()                                                 # in words, for `plan`, `estimate`, reports
    allocator_bytes(profile, mem_bytes, outside_bytes)                 # what the simulated allocator may get
    smallest_surviving_bytes(cost_model, plan, verdict)               # where it stops running out (bisection)
    smallest_mem_bytes(cost_model, plan, verdict, peak_bytes)         # the smallest --mem it fits

[Note: What fits means on a GPU]
  ``--mem`` is the memory of one GPU. Outside the caching allocator, the CUDA context, NCCL's buffers and
  each extra process group's communicator hold the profile's overhead (cost/allocator_accountant.py [Note:
  From walk events to allocator calls]); the allocator gets the rest. A plan fits when the simulation of its
  first two steps (cost/reserved.py [Note: Two steps, not one]), in the allocator mode it runs with
  (``cluster.expandable_segments``; shard_planner/hardware/allocator_conf.py), completes without an out-of-memory error
  on ``usable_fraction`` of that rest (:func:`allocator_bytes`; the margin: [Note: The margin on a GPU]).
  The allocator may release its cache and retry on the way: the step survives, slower ([Note: Retries are
  priced]). The allocated peak alone does not decide: the allocator reserves more than it hands out
  (segments per stream, rounding, blocks it cannot split), and under pressure gives back only whole free
  segments or, with expandable segments, whole free pages. The solver searches with the allocated peak
  (``profile.tensor_budget_bytes``, milliseconds a plan) and judges the plans it answers with this
  (shard_planner/solve/survive.py): 3-50 ms a plan, too slow for the hundreds it compares.

[Note: The margin on a GPU]
  On a GPU profile ``usable_fraction`` is 0.947: the simulated allocator gets 94.7% of ``--mem`` less the
  memory outside it. It covers what the simulation is measured to miss, on the 20 runs of ours on one H200
  (reports/benchmarks/reserved_h200.md, ``benchmarks/bench_reserved.py``; world size 1, expandable segments):
  - the simulated reserved peak is below the measured ``max_memory_reserved`` in every run, by 5.3% in the
    median (0.2% to 16.6%): the walk emits activations as a level and gradients per block, where autograd
    allocates tensor by tensor (cost/reserved.py [Note: What the simulated layout is]). 0.947 = 1 - 5.3%: a
    step whose simulation survives 94.7% of the memory would survive all of it if its layout error were the
    median run's;
  - the allocated peak, 61-72 MiB below the measured one in every run (a constant: 0.2% of a 40 GB budget),
    is inside that reserved error.
  What it does not cover: the runs whose layout error is larger (the MPT-125m and -350m runs, 10-17%, all
  at no memory pressure, where much of the excess is free cache a retry would release, which that figure
  cannot tell from memory a retry cannot release), the profile's outside bytes (``reserved_bytes``, not
  measured: none of those runs read the device's free memory), and world sizes above 1 (NCCL's buffers
  grow with the communicators). What would justify another margin: benchmarks/gpu_allocator.py (run by
  benchmarks/gpu_check.sh) replays each recorded allocation trace through the simulator and sweeps
  ``set_per_process_memory_fraction`` at the predicted memory x {0.95, 1.0, 1.02, 1.05, 1.1}: the smallest
  cap each real step survives against the simulated one sets the margin; the device's free memory there
  sets ``reserved_bytes``.

[Note: Retries are priced]
  A retry (``num_alloc_retries``) releases the allocator's cache: a device synchronisation, every whole free
  segment or page returned to the driver, and what the step needs later allocated or mapped again. A plan
  that fits only with retries says so, with how many per step (the second simulated step's, which every later
  step repeats), and its predicted step time includes their price: cost/retries.py [Note: How retries are
  priced] (the synchronisation as the collective it exposes, the driver calls at the profile's per-call
  times), attached here to the verdict (``retry_price``) and added to the plan's prediction
  (:meth:`FitVerdict.priced`). FSDP reports say retries cost throughput without a figure (pytorch#104509:
  0 retries after ``limit_all_gathers``; composer PR 1632; fms-fsdp issue 63 keeps them at "at most 1 or 2");
  the cap sweep of benchmarks/gpu_allocator.py records step time and ``num_alloc_retries`` at each cap: the
  measured cost per retry to check the price against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shard_planner.hardware.allocator_conf import mode_name
from shard_planner.cost.allocator_blocks import K_LARGE_BUFFER
from shard_planner.cost.allocator_replay import CAP_GRAIN_BYTES
from shard_planner.cost.reserved import ReservedEstimate
from shard_planner.cost.retries import RetryPrice, price_retries
from shard_planner.plan import Plan, Prediction
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.units import format_bytes

# The GPU profiles' usable_fraction, and what `calibrate` writes for a GPU: [Note: The margin on a GPU]
GPU_USABLE_FRACTION = 0.947


def allocator_bytes(profile: HardwareProfile, mem_bytes: int, outside_bytes: int) -> int:
    """The memory the simulated allocator may get on a GPU of ``mem_bytes`` (at most the device's): what is
    not outside it, times the profile's ``usable_fraction`` ([Note: The margin on a GPU])."""
    mem = min(mem_bytes, profile.memory_bytes)
    return max(0, int((mem - outside_bytes) * profile.usable_fraction))


@dataclass(frozen=True)
class FitVerdict:
    """A plan on a GPU of ``mem_bytes``: the allocator without a limit (``free``: the reserved peak, the
    smallest memory without retries) and under ``allocator_bytes`` (``capped``: retries, OOM). See
    [Note: What fits means on a GPU]."""

    mem_bytes: int  # --mem, at most the device's memory
    usable_fraction: float  # the profile's: the margin
    allocator_bytes: int  # what the simulated allocator could get: (mem - outside) x usable_fraction
    free: ReservedEstimate
    capped: ReservedEstimate
    retry_price: RetryPrice | None = None  # what the retries per step cost (None: not priced, as in `estimate`'s
    # other-mode comparison)

    @property
    def expandable_segments(self) -> bool:
        return self.free.expandable_segments

    @property
    def outside_bytes(self) -> int:
        return self.free.outside_bytes

    @property
    def survives(self) -> bool:
        return self.capped.oom_at is None

    @property
    def oom_at(self) -> str | None:
        return self.capped.oom_at

    @property
    def retries_per_step(self) -> int:
        return self.capped.retries_per_step

    @property
    def first_step_retries(self) -> int:
        return self.capped.num_alloc_retries - self.capped.retries_per_step

    @property
    def reserved_peak_total_bytes(self) -> int:
        """The device memory the process holds at its peak without a limit (outside bytes included)."""
        return int(self.free.reserved_peak_total_bytes)

    @property
    def no_retry_total_bytes(self) -> int:
        """The smallest device memory that runs the steps without a retry (outside bytes included)."""
        return int(self.free.no_retry_total_bytes)

    def prediction_fields(self) -> dict[str, int]:
        """The plan file's ``predicted`` figures of the allocator (shard_planner/plan/__init__.py ``Prediction``)."""
        return {"reserved_peak_bytes": self.reserved_peak_total_bytes, "no_retry_bytes": self.no_retry_total_bytes,
                "alloc_retries_per_step": self.retries_per_step, "alloc_retry_s": self.retry_s}

    @property
    def retry_s(self) -> float:
        """What the retries cost a step, in seconds (0.0 when unpriced or none)."""
        return self.retry_price.total_s if self.retry_price is not None else 0.0

    def priced(self, prediction: Prediction) -> Prediction:
        """``prediction`` (the cost model's, without retries) with the allocator's figures and the retries'
        price in its step time, throughput and MFU ([Note: Retries are priced])."""
        fields = dict(self.prediction_fields())
        if self.retry_s > 0:
            step_s = prediction.step_time_s + self.retry_s
            scale = prediction.step_time_s / step_s
            fields.update(step_time_s=step_s, samples_per_s=prediction.samples_per_s * scale,
                          tokens_per_s=None if prediction.tokens_per_s is None else prediction.tokens_per_s * scale,
                          mfu=None if prediction.mfu is None else prediction.mfu * scale)
        return replace(prediction, **fields)

    @property
    def checked_on(self) -> str:
        """Where it was judged: '36.93 GiB of allocator memory (--mem less 1.00 GiB outside it, less the 5.3%
        margin)'."""
        return (f"{format_bytes(self.allocator_bytes)} for the allocator: {format_bytes(self.mem_bytes)} less "
                f"{format_bytes(self.outside_bytes)} outside it, less the {margin_percent(self.usable_fraction)} margin")

    def verdict(self) -> str:
        """'fits 40.00 GiB with 2 cache releases and retries per step, costing 12.3 ms per step (+1.2%: ...)', or
        where it runs out of memory."""
        if not self.survives:
            return (f"DOES NOT FIT {format_bytes(self.mem_bytes)}: the simulated allocator runs out of memory at "
                    f"\"{self.oom_at}\"")
        if self.retries_per_step:
            n = self.retries_per_step
            return (f"fits {format_bytes(self.mem_bytes)} with {n} retr{'ies' if n > 1 else 'y'} per step (each a "
                    f"release of the allocator's cache), "
                    + (self.retry_price.describe() if self.retry_price is not None else "not priced"))
        if self.first_step_retries:
            return f"fits {format_bytes(self.mem_bytes)} (retries in the first step only)"
        return f"fits {format_bytes(self.mem_bytes)} without retries"

    def describe(self) -> str:
        """The verdict and the predictions, in one line, each figure named (:func:`allocator_figures_text`)."""
        return (f"{self.verdict()}; CUDA caching allocator ({mode_name(self.expandable_segments)}, simulated over "
                f"two steps on {self.checked_on}); " + allocator_figures_text(
                    self.reserved_peak_total_bytes, self.no_retry_total_bytes, self.expandable_segments))


def allocator_figures_text(reserved_peak_total_bytes: int, no_retry_total_bytes: int, expandable_segments: bool) -> str:
    """What the simulated allocator's two figures are, in words (``plan``, ``estimate`` and the report say them
    with this): the reserved peak of the two steps with no memory limit, and the smallest memory a cap
    may leave the steps without a retry (``ReservedEstimate.no_retry_bytes``: [Note: The cap and the device's
    memory] in cost/allocator.py; with expandable segments a set_per_process_memory_fraction cap counts whole
    segment sizes where the device counts the pages mapped, so the cap's figure can be well above the peak).
    Neither is the verdict on --mem, which :meth:`FitVerdict.verdict` says."""
    held = (f"with no memory limit it would hold at most {format_bytes(reserved_peak_total_bytes)} (reserved peak, "
            "CUDA context and NCCL included)")
    if expandable_segments:
        return (f"{held}; a set_per_process_memory_fraction cap needs {format_bytes(no_retry_total_bytes)} to run it "
                "without retries (the cap counts whole segments, not the pages mapped)")
    return f"{held}; without retries from {format_bytes(no_retry_total_bytes)} (the peak and the segment then asked for)"


def margin_percent(usable_fraction: float) -> str:
    """The margin in words: '5.3%'."""
    return f"{(1 - usable_fraction) * 100:.3g}%"


def smallest_surviving_bytes(cost_model, plan: Plan, verdict: FitVerdict) -> int:
    """The smallest memory for the allocator (a multiple of 2 MiB) on which ``plan``'s two steps survive in
    ``verdict``'s mode, by bisection between a memory where they fail (more than a page below the allocated
    peak, or ``verdict.allocator_bytes`` when they fail there) and one where they survive (the smallest
    memory without retries, or ``verdict.allocator_bytes`` when they survive there): cost/allocator_replay.py
    [Note: The smallest cap, by bisection], exact where survival is monotone in the memory. At most about
    12 simulations of the two steps."""
    expandable, free, grain = verdict.expandable_segments, verdict.free, CAP_GRAIN_BYTES
    lo = max(0, free.allocated_peak_bytes - K_LARGE_BUFFER) // grain - 1  # fails (-1: no memory below 0)
    hi = -(-free.no_retry_bytes // grain)  # survives: no segment refused
    if verdict.survives:
        hi = min(hi, -(-verdict.allocator_bytes // grain))
    else:
        lo = max(lo, verdict.allocator_bytes // grain)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost_model.reserved(plan, expandable_segments=expandable, device_bytes=mid * grain).oom_at is None:
            hi = mid
        else:
            lo = mid
    return hi * grain


def smallest_mem_bytes(cost_model, plan: Plan, verdict: FitVerdict, peak_bytes: int) -> int:
    """The smallest ``--mem`` ``plan`` fits (``peak_bytes``: its allocated peak, overhead included): its steps
    survive the allocator memory that --mem gives, and its peak is within the search's budget there."""
    profile = cost_model.profile
    survive = verdict.outside_bytes + math.ceil(smallest_surviving_bytes(cost_model, plan, verdict)
                                                / profile.usable_fraction)
    return max(survive, profile.mem_for_tensor_budget(peak_bytes))


def device_fit(cost_model, plan: Plan, expandable_segments: bool | None = None) -> FitVerdict | None:
    """``plan`` on a GPU of its ``--mem`` (``cluster.mem_budget_bytes``) in its allocator mode (or in
    ``expandable_segments``'s when given), by ``cost_model`` (a :class:`~shard_planner.cost.model.CostModel`;
    its reserved simulations are memoised), its retries priced ([Note: Retries are priced]). None on a CPU
    profile: there the allocated peak decides (``profile.tensor_budget_bytes``)."""
    profile = cost_model.profile
    if profile.device != "cuda":
        return None
    expandable = plan.cluster.expandable_segments if expandable_segments is None else expandable_segments
    free = cost_model.reserved(plan, expandable_segments=expandable)
    mem = min(plan.cluster.mem_budget_bytes, profile.memory_bytes)
    cap = allocator_bytes(profile, mem, free.outside_bytes)
    capped = cost_model.reserved(plan, expandable_segments=expandable, device_bytes=cap)
    price = price_retries(capped, cost_model.time(plan), profile) if capped.retries_per_step else None
    return FitVerdict(mem_bytes=mem, usable_fraction=profile.usable_fraction, allocator_bytes=cap, free=free,
                      capped=capped, retry_price=price)
