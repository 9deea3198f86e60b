"""Selective activation checkpointing as torch runs it: a policy that saves the outputs of the aten ops
of the plan's ``ac_save_ops`` classes and recomputes every other op (shard_planner/plan/checkpointing.py);
``"alternate_matmul"`` keeps the odd-numbered matmuls of each checkpointed call (torchtitan's rule:
[Note: torchtitan's op-level policy]), with one counter for the forward and one for the recomputation.

Each op is classified by :func:`shard_planner.trace.kernel_ops.op_class`, the function the tracer
prices kernels by, so the ops the cost model counts as kept (cost/selective.py) are the ops this
policy keeps. torch/utils/checkpoint.py (torch 2.13): ``create_selective_checkpoint_contexts(policy)``
gives the forward's caching dispatch mode (stores MUST_SAVE outputs) and the recomputation's cached mode
(returns them); used as ``checkpoint(fn, ..., use_reentrant=False, context_fn=...)``.
"""

from __future__ import annotations

import logging

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shard_planner.plan.checkpointing import keeps_alternate_matmuls
from shard_planner.trace.kernel_ops import op_class

logger = logging.getLogger(__name__)


def save_ops_policy(save_ops: tuple[str, ...]):
    """The SAC policy function of one checkpointed call: MUST_SAVE for an op of a class in ``save_ops``
    (under ``"alternate_matmul"``, a matmul whose number in its pass is odd), else PREFER_RECOMPUTE."""
    saved = frozenset(save_ops)
    alternate = keeps_alternate_matmuls(save_ops)
    matmuls = {False: 0, True: 0}  # per pass (ctx.is_recompute): the matmuls seen so far

    def policy(ctx, func, *args, **kwargs):
        cls = op_class(func, ctx.op_output)
        if alternate and cls == "matmul":
            matmuls[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if matmuls[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        if cls in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context_fn(save_ops: tuple[str, ...]):
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: selective checkpointing keeping
    ``save_ops``, with a fresh policy (and matmul counters) for every checkpointed call."""
    return lambda: create_selective_checkpoint_contexts(save_ops_policy(save_ops))
