"""Each module's own parameters as built: counts and bytes by dtype, of which 0-d and of which frozen.

A parameter counts at the first module (in ``named_modules()`` order) that registers it directly, so tied
weights count once. "As built" is before the tracer casts floating parameters to the compute dtype
(trace/build.py ``cast_parameters``) and with ``requires_grad`` as ``build_model()`` left it: a model file
that freezes its base weights (``requires_grad_(False)``) is traced as the fine-tune it is. What FSDP2 does
with the frozen ones (all-gathered like the rest; no gradient, reduce-scatter or optimizer state) is in
docs/frozen_facts.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from shard_planner.model.param_storage import stored_parts


@dataclass
class OwnParams:
    """One module's own parameters (``ModuleTrace``'s parameter fields, same names without ``param_``)."""

    count: int = 0
    tensors: int = 0
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)  # dtype name ("float32") -> bytes
    scalar_bytes_by_dtype: dict[str, int] = field(default_factory=dict)  # of bytes_by_dtype, the 0-d ones
    frozen_count: int = 0  # of count, requires_grad False
    frozen_tensors: int = 0
    frozen_bytes_by_dtype: dict[str, int] = field(default_factory=dict)  # of bytes_by_dtype, the frozen ones
    frozen_scalar_bytes_by_dtype: dict[str, int] = field(default_factory=dict)  # of those, the 0-d ones
    quantized_bytes_by_dtype: dict[str, int] = field(default_factory=dict)  # of bytes_by_dtype, quantised weights'
    # (dim0, numel, dtype, trainable) of each plain tensor FSDP2 shards on dim 0 (not 0-d, not a quantised
    # weight's part): its dim-0 padding over N ranks (cost/fsdp2_rules.py [Note: Dim-0 padding])
    sharded_shapes: list[tuple[int, int, str, bool]] = field(default_factory=list)

    def add(self, p: nn.Parameter) -> None:
        """Count ``p``: its elements as the weight it stands for, its bytes as the tensors it stores
        (param_storage.stored_parts: an NF4 weight's inner tensors), those FSDP2 does not shard as the
        0-d ones (whole on every rank)."""
        frozen = not p.requires_grad
        self.count += p.numel()
        self.tensors += 1
        if frozen:
            self.frozen_count += p.numel()
            self.frozen_tensors += 1
        for part in stored_parts(p):
            _add(self.bytes_by_dtype, part.dtype, part.nbytes)
            if not part.sharded:
                _add(self.scalar_bytes_by_dtype, part.dtype, part.nbytes)
            if frozen:
                _add(self.frozen_bytes_by_dtype, part.dtype, part.nbytes)
                if not part.sharded:
                    _add(self.frozen_scalar_bytes_by_dtype, part.dtype, part.nbytes)
            if part.quantized:
                _add(self.quantized_bytes_by_dtype, part.dtype, part.nbytes)
            elif part.sharded:
                self.sharded_shapes.append((part.dim0, part.numel, part.dtype, not frozen))


def _add(by_dtype: dict[str, int], dtype: str, nbytes: int) -> None:
    by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes


def own_params(modules: list[tuple[str, nn.Module]]) -> dict[str, OwnParams]:
    """fqn -> its own parameters (registered directly), for every module of ``modules`` (named_modules())."""
    seen: set[int] = set()
    out: dict[str, OwnParams] = {}
    for fqn, module in modules:
        own = out[fqn] = OwnParams()
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                own.add(p)
    return out
