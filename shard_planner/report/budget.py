"""The budget a report judges a plan against: --mem, and the part of it the planner fills.

The planner fills at most ``profile.tensor_budget_bytes(--mem)`` = min(--mem, device memory) x the
profile's ``usable_fraction`` per GPU by the allocated peak (shard_planner/hardware/profile.py): on a CPU profile the
rest of --mem stays free for the OS and the ranks' processes; on a GPU profile it is the margin of the
caching-allocator simulation, which decides what fits there (cost/fits.py; the plan's ``predicted``
carries its reserved figures). Every part of the report (summary, frontier plot and table, memory
plots) takes one :class:`ReportBudget` from :func:`report_budget`, so they draw the same two lines and
call the same plans fitting. When the plan's profile cannot be loaded here (a plan from another machine
naming a profile path that is not here), the report falls back to --mem alone and says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shard_planner.errors import UserError
from shard_planner.plan import Plan
from shard_planner.hardware.profile import HardwareProfile, rank_word, ranks_text, usable_reason
from shard_planner.units import format_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportBudget:
    """Per-GPU budgets of one plan. ``usable_bytes`` is what plans may fill (``tensor_budget_bytes``);
    without a profile it is --mem and ``usable_fraction`` is None."""

    mem_bytes: int  # --mem, as the plan records it (cluster.mem_budget_bytes)
    usable_bytes: int  # profile.tensor_budget_bytes(mem_bytes); mem_bytes without a profile
    usable_fraction: float | None  # the profile's; None: profile unknown
    device_memory_bytes: int | None = None  # the profile's memory_bytes (caps --mem); None: unknown
    missing_profile: str = ""  # why the profile could not be loaded ("" when it was)
    device: str = "cuda"  # the profile's device: on "cuda" the allocator simulation decides what fits

    @property
    def has_usable(self) -> bool:
        """A usable budget below --mem is known (a second line to draw)."""
        return self.usable_fraction is not None and self.usable_bytes < self.mem_bytes

    def fits(self, peak_bytes: int) -> bool:
        """The peak fits what the planner may fill (--mem alone when the profile is unknown)."""
        return peak_bytes <= self.usable_bytes

    @property
    def usable_reason(self) -> str:
        """How the usable budget follows from --mem: '--mem less the 5.3% margin of the allocator simulation'."""
        return usable_reason(self.mem_bytes, self.device_memory_bytes, self.usable_fraction, self.device,
                             name_mem=False)

    @property
    def mem_label(self) -> str:
        return f"--mem {format_bytes(self.mem_bytes)}"

    @property
    def usable_label(self) -> str:
        return f"usable {format_bytes(self.usable_bytes)}: {self.usable_reason}"

    @property
    def fits_column(self) -> str:
        """The frontier table's fits column, named by the budget it judges against."""
        return "fits the usable budget" if self.has_usable else "fits --mem"

    @property
    def rank_word(self) -> str:
        """What one rank is called in the report, as the command line says it (profile.rank_word)."""
        return rank_word(self.device)

    def ranks(self, count: int) -> str:
        """``count`` ranks in words: "8 GPUs", "2 CPU ranks"."""
        return ranks_text(self.device, count)

    def describe(self) -> str:
        """Both budgets in words, for the summary and captions."""
        per = f"per {self.rank_word}"
        if self.has_usable:
            return f"{self.mem_label} {per}, {format_bytes(self.usable_bytes)} usable ({self.usable_reason})"
        return f"{self.mem_label} {per}" + (f" ({self.fallback_note})" if self.missing_profile else "")

    @property
    def fallback_note(self) -> str:
        """What the report compares against without the profile, and why ("" with the profile)."""
        if not self.missing_profile:
            return ""
        return (f"compared with --mem alone, not the usable budget the planner fills (--mem less the profile's "
                f"margin): {self.missing_profile}")


def load_plan_profile(plan: Plan) -> tuple[HardwareProfile | None, str]:
    """The plan's profile priced as ``plan`` priced it (its module timings, if any), or None and the
    one-line reason it cannot be loaded here."""
    from shard_planner.hardware.profile import load_priced_profile

    try:
        return load_priced_profile(plan.cluster.profile, plan.cluster.timings), ""
    except UserError as exc:
        logger.warning("the plan's profile cannot be loaded (%s): the report compares with --mem alone", exc)
        return None, str(exc)


def report_budget(plan: Plan, profile: HardwareProfile | None = None, missing_profile: str = "") -> ReportBudget:
    """The budgets of ``plan``: --mem and ``profile.tensor_budget_bytes(--mem)``. ``profile`` None:
    the plan's own (:func:`load_plan_profile`), unless ``missing_profile`` already says why it is not here."""
    mem = plan.cluster.mem_budget_bytes
    if profile is None and not missing_profile:
        profile, missing_profile = load_plan_profile(plan)
    if profile is None:
        return ReportBudget(mem, mem, None, missing_profile=missing_profile or "no profile")
    return ReportBudget(mem, profile.tensor_budget_bytes(mem), profile.usable_fraction, profile.memory_bytes,
                        device=profile.device)
