"""CPU ranks that share too few cores: every rank's host work runs slower by the same factor.

[Note: CPU ranks sharing cores]
On a CPU profile the ranks are processes of one host, each running its compute, its framework
overhead and its side of every gloo collective on its own threads. The executor gives each rank
``threads_per_rank(ranks, cores)`` threads (OMP_NUM_THREADS, as torchrun does: ``cores // ranks``, at
least 1; shard_planner/execute/launch.py). While ranks x threads <= cores every thread has a core. Beyond
that the kernel's fair scheduler shares the cores equally among the runnable threads: "CFS basically
models an 'ideal, precise multi-tasking CPU' ... with nr_running tasks, each runs at 1/nr_running speed"
(Linux, Documentation/scheduler/sched-design-CFS.rst; EEVDF, its successor since 6.6, keeps the equal
shares: Documentation/scheduler/sched-eevdf.rst). An FSDP2 step is bulk-synchronous (every collective
waits for every rank), so each rank's step takes

    share = max(1, ranks x threads / cores)

times its time alone. Measured on the CI kind of machine (2 cores, one thread per process, 512^3 bf16
GEMM): 0.56 ms with 1 or 2 processes at once, 1.18-1.22 ms with 4 (share 2).

``HardwareProfile.host_cores`` says how many cores the ranks of a host share (0: unknown, GPU profiles:
no sharing). What the profile measured is scaled by the ratio of the plan's share to the share it was
measured under:

- compute constants (peak FLOP/s, memory bandwidth, per-op overhead) were measured by one process:
  share 1, so they scale by the plan's share;
- the collectives and the per-unit and optimizer overheads were measured with ``measured_ranks`` ranks
  running at once (``calibrate --world-size``): they scale by share(plan) / share(measured_ranks);
- module timings were measured in ``world_size`` processes at once with ``threads_per_rank`` threads
  each (execute/module_timing.py): they scale by share(plan) / share(theirs).

Not modelled: when ranks outnumber cores, a rank woken by a collective may wait for a scheduler slice
before it runs, which adds to every ring step beyond the equal share (measured here: FSDP2's per-unit
cost at 4 ranks on 2 cores is 5.5x that at 2 ranks, where the share accounts for 2x). A profile
calibrated at the plan's world size (``calibrate --world-size N``) holds those waits in its collective
and per-unit figures.
"""

from __future__ import annotations

import os
from dataclasses import replace

from shard_planner.hardware.profile import HardwareProfile
from shard_planner.hardware.timings import ModuleTime, ModuleTimings


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_rank(ranks: int, cores: int) -> int:
    """The threads the executor gives each of ``ranks`` ranks on ``cores`` cores when OMP_NUM_THREADS
    is not set (as torchrun does): the cores split evenly, at least one."""
    return max(1, cores // max(1, ranks))


def core_share(ranks: int, cores: int, threads: int | None = None) -> float:
    """How many times slower each rank runs than alone when ``ranks`` ranks of ``threads`` threads each
    (default: ``threads_per_rank``) share ``cores`` cores ([Note: CPU ranks sharing cores]); 1 when
    ``cores`` is 0 (unknown)."""
    if cores <= 0 or ranks <= 0:
        return 1.0
    t = threads if threads is not None else threads_per_rank(ranks, cores)
    return max(1.0, ranks * t / cores)


def ranks_per_host(profile: HardwareProfile, world_size: int) -> int:
    """The ranks of a ``world_size`` job that run on one host of ``profile``."""
    return min(world_size, max(1, profile.interconnect.gpus_per_node))


def host_factors(profile: HardwareProfile, world_size: int) -> tuple[float, float, float]:
    """(compute, measured-overhead, module-timings) factors by which a ``world_size`` plan's host work
    is slower than ``profile`` measured it ([Note: CPU ranks sharing cores]); all 1 on a GPU profile or
    when ``profile.host_cores`` is 0."""
    if profile.device != "cpu" or profile.host_cores <= 0:
        return 1.0, 1.0, 1.0
    cores = profile.host_cores
    share = core_share(ranks_per_host(profile, world_size), cores)
    overheads = share / core_share(profile.measured_ranks, cores) if profile.measured_ranks > 0 else share
    t = profile.module_timings
    timed = share / core_share(t.world_size, cores, t.threads_per_rank) if t is not None else 1.0
    return share, overheads, timed


def _scaled_timings(t: ModuleTimings, f: float) -> ModuleTimings:
    def scaled(m: ModuleTime) -> ModuleTime:
        return replace(m, fwd_s=m.fwd_s.scaled(f), bwd_s=m.bwd_s.scaled(f))
    return replace(t, modules={k: scaled(m) for k, m in t.modules.items()},
                   loss_fwd_s=t.loss_fwd_s.scaled(f), loss_bwd_s=t.loss_bwd_s.scaled(f))


def shared_profile(profile: HardwareProfile, world_size: int) -> HardwareProfile:
    """``profile`` as a ``world_size`` plan's ranks see it when they share the host's cores: rates
    divided and times multiplied by :func:`host_factors`; ``profile`` itself when they are all 1. The
    result has ``host_cores`` 0 (its figures are already shared)."""
    compute, over, timed = host_factors(profile, world_size)
    if compute == over == timed == 1.0:
        return profile
    ic = profile.interconnect
    return replace(
        profile,
        peak_flops_per_s={k: v / compute for k, v in profile.peak_flops_per_s.items()},
        memory_bandwidth_bytes_per_s=profile.memory_bandwidth_bytes_per_s / compute,
        host_to_device_bytes_per_s=profile.host_to_device_bytes_per_s / compute,
        host_memory_bandwidth_bytes_per_s=(profile.host_memory_bandwidth_bytes_per_s / compute
                                           if profile.host_memory_bandwidth_bytes_per_s else None),
        per_op_overhead_s=profile.per_op_overhead_s * compute,
        per_unit_overhead_s=profile.per_unit_overhead_s * over,
        per_param_tensor_optimizer_overhead_s=profile.per_param_tensor_optimizer_overhead_s * over,
        plain_tensor_optimizer_overhead_s=(profile.plain_tensor_optimizer_overhead_s * over
                                           if profile.plain_tensor_optimizer_overhead_s is not None else None),
        interconnect=replace(
            ic, intra_node_latency_s=ic.intra_node_latency_s * over,
            intra_node_busbw_bytes_per_s=ic.intra_node_busbw_bytes_per_s / over,
            inter_node_latency_s=ic.inter_node_latency_s * over,
            inter_node_busbw_bytes_per_s=ic.inter_node_busbw_bytes_per_s / over),
        module_timings=(_scaled_timings(profile.module_timings, timed)
                        if profile.module_timings is not None else None),
        host_cores=0,
    )
