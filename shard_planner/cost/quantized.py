"""The time a quantised weight costs to use: NF4 dequantisation, priced where the compute model does not
see it.

[Note: NF4 dequantisation time]
torchao's NF4 weight (shard_planner/model/param_storage.py [Note: NF4 parameters as stored]) is dequantised to
the input's dtype wherever it is used, forward and backward (torchao 0.18 nf4_tensor.py: ``linear_nf4`` /
``LinearNF4.forward`` and ``.backward`` call ``weight.to(dtype)`` -> ``get_original_weight``), by a chain
of eager elementwise ops: unpacking the 4-bit codes, looking them up in the code table, dequantising the
scalers and multiplying. Those ops have no FLOPs, so the "flops" compute model (traced FLOPs at the
profile's achievable FLOP/s, whose efficiency is fitted to models of matmuls and attention) prices them
at nothing; for a QLoRA 70B step they are a third of the time. The trace records them as memory-bound
kernels of the module that owns the weight (trace/kernel_ops.py, [Note: kernel records]: their bytes
read and written), so here a module that holds quantised parameters (``ModuleTrace.
quantized_param_bytes_by_dtype``) adds the bytes of its own memory-bound kernels at the device's
achieved HBM bandwidth (cost/fsdp_copies.py ``copy_bandwidth_bytes_per_s``), forward and backward; a
checkpointed block's recomputation repeats the forward's. The "roofline" model prices every kernel
already and measured module times hold it, so neither adds it; a CPU profile prices every memory-bound
kernel's bytes (cost/kernels.py [Note: memory-bound kernels on a CPU priced from FLOPs]), these included.
"""

from __future__ import annotations

from shard_planner.cost.fsdp_copies import copy_bandwidth_bytes_per_s
from shard_planner.cost.kernels import MEMORY_BOUND
from shard_planner.trace.types import ModelTrace


def dequantisation_s(trace: ModelTrace, micro_batch: int, profile) -> dict[str, tuple[float, float]]:
    """Per module holding quantised parameters, the forward and backward seconds of its own
    memory-bound kernels on ``profile`` ([Note: NF4 dequantisation time]); empty when none does or
    the profile does not price device copies."""
    bw = copy_bandwidth_bytes_per_s(profile)
    if bw <= 0.0:
        return {}
    out = {}
    for m in trace.modules:
        if m.quantized_param_bytes_by_dtype:
            out[m.fqn] = tuple(sum(r.bytes.at(micro_batch) for r in records if r.op_class in MEMORY_BOUND) / bw
                               for records in (m.fwd_kernels, m.bwd_kernels))
    return out


def subtree_dequantisation_s(trace: ModelTrace, fqn: str, per_module: dict[str, tuple[float, float]],
                             own_only: bool = False) -> tuple[float, float]:
    """Of ``per_module`` (:func:`dequantisation_s`), the sum over ``fqn``'s subtree (``own_only``: the
    module alone)."""
    if not per_module:
        return 0.0, 0.0
    modules = (trace.module(fqn),) if own_only else trace.subtree(fqn)
    parts = [per_module[m.fqn] for m in modules if m.fqn in per_module]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)
