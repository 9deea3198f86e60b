"""What a parameter stores, as FSDP2 shards and gathers it: one part for a plain tensor, several for a
quantised one (torchao's NF4). The trace records these parts (trace/params.py) and ``run`` predicts its
collectives from them (execute/comm_count.py), so both see the same bytes.

[Note: NF4 parameters as stored]
torchao's ``NF4Tensor`` (``to_nf4``; torchao 0.18 torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py)
is a wrapper tensor subclass: its ``dtype`` and ``shape`` are the original weight's (bf16, (out, in)), and
``numel() * element_size()`` says 2 bytes an element, but it holds five inner tensors
(``__tensor_flatten__``), for a weight of n elements with ``block_size`` b = 64 and ``scaler_block_size``
s = 256:

- ``quantized_data``: uint8, n / 2 (two 4-bit codes a byte);
- ``quantized_scalers``: int8, n / b (each block's absmax, quantised again: "double quantisation");
- ``quantization_factor``: the original dtype, n / (b s) (one factor per block of scalers);
- ``scaler_mean``: 0-d, the original dtype; ``nf4``: the 16 code values, the original dtype.

FSDP2 shards an NF4 weight by ``torch.chunk`` on dim 0, which NF4 implements by splitting each of its
inner tensors into equal parts (``nf4_split``), and all-gathers what ``fsdp_pre_all_gather`` returns:
``(quantized_scalers, quantization_factor, quantized_data)``; ``fsdp_post_all_gather`` wraps the gathered
tensors as the unsharded NF4 weight without a copy, and ``scaler_mean`` and ``nf4`` travel in the
metadata: every rank's shard keeps its own. So an NF4 weight is about 0.516 bytes an element
(1/2 + 1/64 + 2/16384 for bf16), not 2: three sharded parts (1-D, split evenly: they must divide by the
shard group, which NF4 asserts) and two replicated ones. Mixed precision does not cast them
(``fsdp_post_all_gather`` ignores ``param_dtype``), not even the floating factors of a weight built in fp32
(the trace says which bytes are such: ``ModuleTrace.quantized_param_bytes_by_dtype``); they never get a
gradient (QLoRA freezes the base).
Where the weight is used (``F.linear``, ``LinearNF4``) it is dequantised to the input's dtype, forward and
backward: those temporaries are ordinary ops, traced as they run.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# torchao's NF4Tensor: its inner tensors FSDP2 shards and all-gathers (fsdp_pre_all_gather's), then those each
# shard keeps whole (fsdp_pre_all_gather's metadata). See [Note: NF4 parameters as stored].
NF4_SHARDED = ("quantized_data", "quantized_scalers", "quantization_factor")
NF4_REPLICATED = ("scaler_mean", "nf4")
_NF4_MODULES = ("torchao.quantization", "torchao.dtypes")  # where torchao exports NF4Tensor (0.18; older)
NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"  # where 0.18 defines it


@dataclass(frozen=True)
class StoredPart:
    """One tensor a parameter stores: its dtype name ("uint8"), elements, dim-0 size, whether FSDP2 shards it
    (False: whole on every rank: a 0-d parameter, a quantised weight's metadata), and whether it is part of a
    quantised weight (gathered through the tensor's own extension: mixed precision casts none of it)."""

    dtype: str
    numel: int
    dim0: int
    sharded: bool
    quantized: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * getattr(torch, self.dtype).itemsize


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def is_nf4(p: torch.Tensor) -> bool:
    """Whether ``p`` is a torchao NF4Tensor (never true where torchao was not imported)."""
    for name in _NF4_MODULES:
        cls = getattr(sys.modules.get(name), "NF4Tensor", None)
        if isinstance(cls, type) and isinstance(p, cls):
            return True
    return False


def stored_parts(p: torch.Tensor) -> tuple[StoredPart, ...]:
    """The tensors ``p`` stores, as FSDP2 shards them: itself for a plain tensor (sharded on dim 0 unless
    0-d); an NF4 weight's inner tensors ([Note: NF4 parameters as stored])."""
    if is_nf4(p):
        parts = [(getattr(p, name), True) for name in NF4_SHARDED] + [(getattr(p, name), False) for name in NF4_REPLICATED]
        return tuple(StoredPart(_dtype_name(t), int(t.numel()), int(t.shape[0]) if t.dim() else 1, sharded, True)
                     for t, sharded in parts)
    if hasattr(type(p), "fsdp_pre_all_gather"):  # a tensor subclass FSDP2 gathers its own way
        logger.warning("a parameter of type %s is counted as %s elements of %s: what it stores and FSDP2 gathers "
                       "is not known here", type(p).__name__, p.numel(), p.dtype)
    return (StoredPart(_dtype_name(p), int(p.numel()), int(p.shape[0]) if p.dim() else 1, p.dim() > 0),)
