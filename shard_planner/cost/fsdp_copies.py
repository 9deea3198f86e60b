"""FSDP2's own copies on the compute stream, per unit and step (the two-stream simulation, cost/time.py,
and the solver's linear model, solve/linear.py).

[Note: FSDP2's copies on the compute stream] FSDP2 keeps each parameter as its own tensor, so its
collectives run on flat buffers that it copies into and out of (torch 2.13,
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):

- copy-out, after every all-gather (forward, and backward when the unit resharded):
  ``foreach_all_gather_copy_out`` makes the current stream wait for the all-gather and runs
  ``split_with_sizes_copy`` of the flat output into the unsharded parameters on it: the compute
  stream reads and writes the unit's unsharded bytes in the param dtype (2 x ``UnitBytes.unsharded``);
- copy-in, before every reduce-scatter: ``foreach_reduce`` runs ``foreach_reduce_scatter_copy_in``
  (``chunk_cat`` of the unsharded gradients into the reduce-scatter input, cast to the reduce dtype) on
  the current stream *before* ``reduce_scatter_stream.wait_stream(current_stream)``: it reads the
  gradients in the param dtype and writes the input in the reduce dtype (``UnitBytes.unsharded`` +
  ``UnitBytes.rs_input``), and the reduce-scatter waits for it.

The all-gather's copy-in (shards into the flat input) runs on its own stream and the reduce-scatter's
division and the post-reduce cast of the 1/N output touch 1/N of the bytes: neither is counted. The
copies are memory-bound kernels priced at the device's achieved HBM bandwidth (the roofline's
``memory_bandwidth_bytes_per_s`` x ``[kernels] memory_efficiency``, the datasheet figure without a
[kernels] table). On a CPU profile they are 0: the per-unit overhead that ``calibrate`` measures holds
them. FSDP1 (``FlatParameter``) all-gathers and reduce-scatters in place and has neither
(``HardwareProfile.fsdp_copies = False``, what benchmarks/bench_published.py sets for its FSDP1 runs).
For Llama 3 8B in bf16 with fp32 reduction that is (2 x 2 + 2 x 2 + 2 + 4) x 8.0e9 = 112 GB a step, 61 ms
on an A100 80GB: 2% of torchtitan's 64-GPU step at local batch 1.
"""

from __future__ import annotations

from shard_planner.cost.kernels import kernel_constants
from shard_planner.hardware.profile import HardwareProfile


def copy_bandwidth_bytes_per_s(profile: HardwareProfile) -> float:
    """Achieved HBM bandwidth of a device copy on ``profile``; 0 where the copies are not priced."""
    if profile.device == "cpu" or not profile.fsdp_copies:
        return 0.0
    kc = kernel_constants(profile)
    return profile.memory_bandwidth_bytes_per_s * (kc.memory_efficiency if kc is not None else 1.0)


def copies_s(unsharded_bytes: float, rs_input_bytes: float, bw: float) -> tuple[float, float]:
    """Seconds of one all-gather copy-out and of the reduce-scatter copy-in of a unit whose all-gather
    output is ``unsharded_bytes`` and reduce-scatter input ``rs_input_bytes``, at copy bandwidth ``bw``
    (> 0): [Note: FSDP2's copies on the compute stream]."""
    return 2.0 * unsharded_bytes / bw, (unsharded_bytes + rs_input_bytes) / bw
