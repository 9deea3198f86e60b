"""Compute slowed down by collectives that run beside it (the two-stream simulation, cost/time.py).

[Note: Compute slowdown under overlapped collectives]
FSDP hides its all-gathers and reduce-scatters behind compute on a second stream, but the two are not
independent: an NCCL collective is a kernel that holds one CTA per channel on its SMs for as long as it
runs, and its copies and reductions take HBM bandwidth, so the GEMMs and attention kernels launched
beside it get fewer SMs (an extra wave when their grid no longer fits) and less bandwidth. Measured:

- Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
  Learning: Performance and Power Implications" (arXiv 2507.03114, 2025), GPT and LLaMA training
  steps on 4 x A100, H100, MI250 and MI210: compute kernels that overlap communication run on average
  18.9% slower (at most 40.0%) than the same kernels with no communication beside them.
- One case of the mechanism (NVIDIA developer forums, "Compute-Communication Overlap Causes Severe
  GEMM Performance Degradation because of Tail Effect", 2025): on an H100 (132 SMs) a 132-CTA GEMM
  beside a 24-CTA ncclAllGather needs a second wave and takes nearly twice as long; 24 of 132 SMs
  alone would cost 22%.

The profile's ``overlap_compute_slowdown`` is that slowdown ``s``: while the communication stream is
busy, the compute stream progresses at 1 / (1 + s) of its speed alone. A block of ``w`` seconds of
compute that starts at ``t0`` with the communication stream busy until ``c1`` therefore ends at

    t0 + w (1 + s)                           if it ends before c1 (w (1 + s) <= c1 - t0)
    c1 + w - (c1 - t0) / (1 + s)             otherwise (at full speed after c1)

so a collective hidden for ``h`` seconds behind compute costs ``h s / (1 + s)`` seconds of step time
(:func:`hidden_comm_cost_share`): never more than exposing it would. 0 (the default: CPU profiles,
profiles written before the term, GPUs without a measurement) prices exactly as before. The
collectives themselves are priced as measured alone (nccl-tests, cost/collectives.py).
"""

from __future__ import annotations


def overlapped_compute_end_s(start_s: float, work_s: float, comm_busy_until_s: float, slowdown: float) -> float:
    """When ``work_s`` seconds of compute (its time alone on the device) that start at ``start_s`` end,
    with the communication stream busy until ``comm_busy_until_s`` and compute running 1 / (1 +
    ``slowdown``) as fast meanwhile ([Note: Compute slowdown under overlapped collectives])."""
    if slowdown <= 0.0 or work_s <= 0.0 or comm_busy_until_s <= start_s:
        return start_s + work_s
    overlap_s = comm_busy_until_s - start_s
    stretched_s = work_s * (1.0 + slowdown)
    if stretched_s <= overlap_s:
        return start_s + stretched_s
    return comm_busy_until_s + work_s - overlap_s / (1.0 + slowdown)


def hidden_comm_cost_share(slowdown: float) -> float:
    """Seconds of step time one second of collective hidden behind compute costs: s / (1 + s)."""
    return slowdown / (1.0 + slowdown) if slowdown > 0.0 else 0.0
