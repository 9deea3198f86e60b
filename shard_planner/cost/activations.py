"""Per block of the cost tables, the activation sizes the memory walk reads at one micro-batch
(cost/memory.py, [Note: Activations] and [Note: Checkpointed inputs held elsewhere] there)."""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.cost.tables import CostTables
from shard_planner.dtypes import dtype_bytes
from shard_planner.plan.numerics import Numerics
from shard_planner.trace.types import ModelTrace


@dataclass(frozen=True)
class BlockActivations:
    """Per block of the tables at one micro-batch, bytes in the plan's param dtype (activations are
    traced in the compute dtype and scaled, [Note: Activations]). ``block_activations`` builds them;
    the CostModel keeps them per (segmentation, micro-batch, param dtype)."""

    input: tuple[float, ...]
    output: tuple[float, ...]
    saved: tuple[float, ...]
    fwd_rise: tuple[float, ...]
    bwd_rise: tuple[float, ...]
    kept: tuple[float, ...]  # what a checkpointed block keeps: [Note: Checkpointed inputs held elsewhere]
    flows: tuple[bool, ...]  # a module block (its input and output flow); False: a container's own code
    held: tuple[float, ...]  # held by the forward's output until the loss: trace/held.py
    tail_rise: tuple[float, ...]  # a container's own code: [Note: A container's own code] (cost/memory.py)
    own_grads: tuple[float, ...]  # its own parameters' gradients in the param dtype, less ``made_grads``:
    made_grads: tuple[float, ...]  # those its forward made and saved (a fused loss, ModuleTrace.forward_grad_bytes)
    names: tuple[str, ...]  # the block's name (the owner of its allocations; ``CostTables.blocks[i].name``)


def block_activations(trace: ModelTrace, t: CostTables, micro_batch: int, numerics: Numerics) -> BlockActivations:
    b, elem = micro_batch, dtype_bytes(numerics.activation_dtype)
    s = elem / dtype_bytes(trace.compute_dtype)
    blocks = t.blocks
    grads = [blk.own_float_numel * elem for blk in blocks]
    made = [min(blk.forward_grads.at(b) * s, g) for blk, g in zip(blocks, grads)]
    return BlockActivations(
        input=tuple(blk.input.at(b) * s for blk in blocks), output=tuple(blk.output.at(b) * s for blk in blocks),
        saved=tuple(blk.saved.at(b) * s for blk in blocks), fwd_rise=tuple(blk.fwd_rise.at(b) * s for blk in blocks),
        bwd_rise=tuple(blk.bwd_rise.at(b) * s for blk in blocks),
        kept=tuple((blk.input.at(b) - blk.input_shared.at(b)) * s for blk in blocks),
        flows=tuple(not blk.self_only for blk in blocks), held=tuple(blk.held.at(b) * s for blk in blocks),
        tail_rise=tuple(blk.tail_rise.at(b) * s for blk in blocks),
        own_grads=tuple(g - m for g, m in zip(grads, made)), made_grads=tuple(made),
        names=tuple(blk.name for blk in blocks),
    )
