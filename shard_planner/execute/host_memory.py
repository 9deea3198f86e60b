"""A CPU run's host memory: what its ranks need at least, what the machine has, checked before launching.

[Note: A CPU run's host memory]
On CPU every rank builds the whole model in host memory (execute/stepper.py ``build_on_device``: the model
file's ``build()`` on the CPU, at full size, before ``fully_shard`` shards it) and then trains the plan's
step, whose peak per rank the plan predicts (``predicted.peak_bytes`` less its ``overhead`` category, the
CUDA context and NCCL buffers a CPU rank has not; only when the run keeps the plan's world size: a re-derived
plan's prediction does not apply). So a rank holds at least the larger of the two (:func:`rank_need_bytes`),
and the run ``world_size`` times that. The figure is a lower bound: it leaves out each process's
interpreter and torch (0.5-0.8 GiB of RSS, DESIGN.md "FSDP2 facts") and the allocator's slack, so a run
it refuses cannot fit. What the machine has (:func:`available_host_bytes`): ``MemAvailable`` of
/proc/meminfo (the kernel's estimate of the memory new work can take without swapping,
Documentation/filesystems/proc.rst), and, under a cgroup memory limit, that limit less what the group
already uses (cgroup v2 ``memory.max`` - ``memory.current``; v1 ``memory.limit_in_bytes`` -
``memory.usage_in_bytes``). A rank the kernel kills with SIGKILL (the OOM killer's signal) is named as
likely out of host memory, with these figures (:meth:`HostMemory.killed_text`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shard_planner.errors import RunError
from shard_planner.plan import Plan
from shard_planner.units import format_bytes

NO_LIMIT_BYTES = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class HostMemory:
    """The ranks' host memory at launch: the least each needs, how many there are, what the machine had."""

    rank_need_bytes: int
    world_size: int
    available_bytes: int | None  # None: not readable here (no /proc/meminfo)

    @property
    def need_bytes(self) -> int:
        return self.rank_need_bytes * self.world_size

    def check(self) -> None:
        """RunError (one line, the figures) when the ranks cannot fit in what the machine has."""
        if self.available_bytes is not None and self.need_bytes > self.available_bytes:
            raise RunError(f"the {self.world_size} CPU rank(s) need at least {format_bytes(self.need_bytes)} of host "
                           f"memory ({format_bytes(self.rank_need_bytes)} each: the model as each builds it, or the "
                           f"plan's predicted peak) but this machine has {format_bytes(self.available_bytes)} "
                           "available: run fewer ranks (--world-size), a smaller model, or on GPUs")

    def killed_text(self) -> str:
        """What a rank killed by SIGKILL likely means, with the figures."""
        had = f" of the {format_bytes(self.available_bytes)} available at launch" if self.available_bytes else ""
        return (f"likely out of host memory: the kernel's OOM killer sends SIGKILL; the {self.world_size} ranks need "
                f"at least {format_bytes(self.need_bytes)} ({format_bytes(self.rank_need_bytes)} each){had}")


def rank_need_bytes(plan: Plan, built_bytes: int, world_size: int) -> int:
    """The least host memory one CPU rank of ``plan`` holds on ``world_size`` ranks, its model ``built_bytes``
    as built ([Note: A CPU run's host memory])."""
    p = plan.predicted
    if p is None or world_size != plan.mesh.world_size:
        return built_bytes
    return max(built_bytes, p.peak_bytes - int(p.memory_at_peak.get("overhead", 0)))


def available_host_bytes(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The host memory new processes can take: MemAvailable, or less under a cgroup limit; None when unknown."""
    try:
        fields = dict(line.split(":", 1) for line in (proc / "meminfo").read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024  # "22500816 kB"
    except (OSError, KeyError, ValueError):
        return None
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit_bytes, usage_bytes = int((cgroup / limit).read_text()), int((cgroup / usage).read_text())
        except (OSError, ValueError):  # absent, or "max": no limit
            continue
        if limit_bytes < NO_LIMIT_BYTES:
            available = min(available, max(0, limit_bytes - usage_bytes))
    return available
