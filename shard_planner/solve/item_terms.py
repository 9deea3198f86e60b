"""What the linear model reads of each item of a search space at one micro-batch (solve/linear.py): its
activation bytes, its compute seconds and, when a candidate is checkpointed, what recomputation keeps
and skips. Every candidate of a global choice sums these over its items.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.plan.checkpointing import DEFAULT_SAVE_OPS, is_selective
from shard_planner.cost.model import CostModel
from shard_planner.plan.numerics import Numerics
from shard_planner.solve.space import SearchSpace
from shard_planner.trace.types import ModelTrace


@dataclass(frozen=True)
class ItemTerms:
    """Per item of the space, at the choice's micro-batch: activation bytes in the param dtype (everything
    saved in its subtree, its input, its traced forward and backward rises), compute seconds (forward,
    backward) and ``sac`` (:func:`selective_terms`: None when no candidate is checkpointed)."""

    saved: tuple[float, ...]
    inputs: tuple[float, ...]
    fwd_rise: tuple[float, ...]
    bwd_rise: tuple[float, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    sac: tuple | None


def item_terms(cm: CostModel, trace: ModelTrace, space: SearchSpace, micro_batch: int, numerics: Numerics,
               act_scale: float) -> ItemTerms:
    """Every item's terms at ``micro_batch`` under ``numerics`` (bytes / FLOPs at that batch; activations x
    ``act_scale``, the activation dtype's bytes over the traced compute dtype's), ``cm`` the CostModel as the
    choice's ranks see the profile."""
    b = micro_batch
    items = space.items
    saved = [cm.subtree_sum(it.fqn, "saved_bytes_self").at(b) * act_scale for it in items]
    inputs = [trace.module(it.fqn).input_bytes.at(b) * act_scale for it in items]
    fwd_rise = [trace.module(it.fqn).fwd_peak_rise_bytes.at(b) * act_scale for it in items]
    bwd_rise = [trace.module(it.fqn).bwd_peak_rise_bytes.at(b) * act_scale for it in items]
    # compute seconds: measured when the profile has module timings, else FLOPs / throughput
    # (cost.module_compute_s; see "Time per candidate" in solve/linear.py's docstring)
    fwd_s, bwd_s = zip(*(cm.module_compute_s(it.fqn, b, numerics) for it in items))
    sac = selective_terms(cm, space, b, numerics, act_scale)
    return ItemTerms(tuple(saved), tuple(inputs), tuple(fwd_rise), tuple(bwd_rise), fwd_s, bwd_s, sac)


def selective_terms(cm: CostModel, space: SearchSpace, micro_batch: int, numerics: Numerics, act_scale: float):
    """Per item, selective checkpointing's stash (bytes in the activation dtype), the share of its forward
    that recomputation skips, and the share full checkpointing's early stop skips (cost/selective.py);
    None when no candidate is checkpointed."""
    options = [c.option.activation_checkpoint for c in space.candidates]
    if not any(options):
        return None
    stash, share, tail = [], [], []
    any_selective = any(is_selective(o) for o in options)
    for it in space.items:
        s, skipped, total = (cm.subtree_selective(it.fqn, DEFAULT_SAVE_OPS, micro_batch, numerics)
                             if any_selective else (0.0, 0.0, 0.0))
        stash.append(s * act_scale)
        share.append(min(1.0, skipped / total) if total > 0 else 0.0)
        tail.append(cm.early_stop_share(it.fqn, micro_batch, numerics))
    return stash, share, tail
