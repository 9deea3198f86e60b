"""What a plan file's ``predicted`` section holds: the chosen plan's predicted peak memory (by category), step
time, throughput and, on a GPU, the caching allocator's figures. plan/__init__.py re-exports both names; the cost model
fills them (cost/types.py ``Estimate.prediction``, cost/fits.py the allocator's figures)."""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.errors import PlanError

# The plan file's memory categories, in the one order every consumer uses (``memory_at_peak``, the timeline,
# the report's stacked plot); written here only. cost/allocations.py reports each allocation kind in one.
MEMORY_CATEGORIES = (
    "sharded_params",
    "unsharded_params",
    "grads",
    "optimizer_states",
    "activations",
    "temporaries",
    "comm_buffers",
    "overhead",
)


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    step_time_s: float  # one optimizer step: every micro-step of accumulation and the optimizer's step
    memory_at_peak: dict[str, int]  # bytes by category, MEMORY_CATEGORIES
    samples_per_s: float
    tokens_per_s: float | None = None
    exposed_comm_s: float = 0.0
    mfu: float | None = None
    # On a GPU, the CUDA caching allocator over the first two steps in the plan's allocator mode (cost/fits.py;
    # None on CPU profiles and in plans written before): the device memory the process holds at its peak,
    # the smallest device memory that runs the steps without a retry, and the retries per step (each a
    # release of the allocator's cache) on --mem less the margin, where the plan was judged to fit. Each
    # counts the profile's memory outside the allocator (CUDA context, NCCL) as the peak does. And what those
    # retries cost a step, in seconds, which step_time_s includes (cost/retries.py; 0.0 without retries).
    reserved_peak_bytes: int | None = None
    no_retry_bytes: int | None = None
    alloc_retries_per_step: int | None = None
    alloc_retry_s: float | None = None

    def __post_init__(self):
        unknown = set(self.memory_at_peak) - set(MEMORY_CATEGORIES)
        if unknown:
            raise PlanError(f"predicted.memory_at_peak has unknown categories {sorted(unknown)}")

    def retries_text(self, sep: str = "") -> str:
        """The allocator's retries on --mem as the plan file keeps them, after ``sep``: 'fits with 2 retries per
        step, costing 12.3 ms per step (+1.2%), in the step time'; '' off a GPU (or in a plan written before)."""
        n = self.alloc_retries_per_step
        if n is None:
            return ""
        if not n:
            return f"{sep}no retries on --mem"
        if self.alloc_retry_s is None:
            return f"{sep}fits with {n} retr{'ies' if n > 1 else 'y'} per step (not priced: written before they were)"
        base_s = self.step_time_s - self.alloc_retry_s
        return (f"{sep}fits with {n} retr{'ies' if n > 1 else 'y'} per step, costing {self.alloc_retry_s * 1e3:.3g} ms "
                f"per step ({100 * self.alloc_retry_s / base_s if base_s > 0 else 0.0:+.2g}%), in the step time")

    @property
    def throughput_text(self) -> str:
        """For people: ``12,345 tokens/s`` for a model with tokens, else ``3.2 samples/s`` (whole cluster)."""
        return f"{self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else f"{self.samples_per_s:,.1f} samples/s"
