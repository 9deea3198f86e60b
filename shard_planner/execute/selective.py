"""Selective activation checkpointing as torch runs it: a policy that saves the outputs of the aten ops
of the plan's ``ac_save_ops`` classes and recomputes every other op (shard_planner/checkpointing.py).

Each op is classified by :func:`shard_planner.trace.kernel_ops.op_class`, the function the tracer
prices kernels by, so the ops the cost model counts as kept (cost/selective.py) are the ops this
policy keeps. torch/utils/checkpoint.py (torch 2.13): ``create_selective_checkpoint_contexts(policy)``
gives the forward's caching dispatch mode (stores MUST_SAVE outputs) and the recomputation's cached mode
(returns them); used as ``checkpoint(fn, ..., use_reentrant=False, context_fn=...)``.
"""

from __future__ import annotations

import functools
import logging

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shard_planner.trace.kernel_ops import op_class

logger = logging.getLogger(__name__)


def save_ops_policy(save_ops: tuple[str, ...]):
    """The SAC policy function: MUST_SAVE for an op of a class in ``save_ops``, else PREFER_RECOMPUTE."""
    saved = frozenset(save_ops)

    def policy(ctx, func, *args, **kwargs):
        if op_class(func, ctx.op_output) in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context_fn(save_ops: tuple[str, ...]):
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: selective checkpointing keeping ``save_ops``."""
    return functools.partial(create_selective_checkpoint_contexts, save_ops_policy(save_ops))
