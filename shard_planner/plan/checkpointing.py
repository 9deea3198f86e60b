"""Activation checkpointing policies a plan unit can hold, as values (no torch, no cost model).

A unit's ``activation_checkpoint`` is ``False`` (none), ``True`` (full: torch.utils.checkpoint keeps the
unit's inputs and recomputes its whole forward in backward) or ``"selective"`` with ``ac_save_ops``, the
op classes whose outputs are kept (trace/kernel_ops.py classifies every aten op into one; the classes are
those of cost/kernels.py OP_CLASSES). torch's selective checkpointing (torch/utils/checkpoint.py,
``create_selective_checkpoint_contexts``, torch 2.13) runs the forward under a dispatch mode that keeps
the outputs of every op whose policy is MUST_SAVE and recomputes the others in backward; the executor
(execute/apply.py) maps each aten op to its class with the tracer's own classification, so what is
priced is what runs. "Every k-th block" is per-unit choice: full AC on every k-th unit.

[Note: torchtitan's op-level policy] torchtitan's ``selective_ac_option = "op"``
(torchtitan/models/llama3/infra/parallelize.py, ``_save_list`` and ``_get_custom_policy``) saves the
outputs of ``aten.mm``, the SDPA kernels (flash, efficient, cuDNN) and the reduce-scatter of tensor
parallelism, and recomputes every second ``mm`` of a block: a counter per checkpointed region and pass
(forward, recomputation) numbers the mms from 1 and an even number is recomputed. The pseudo-class
``"alternate_matmul"`` is that rule: the outputs of the odd-numbered ops of the matmul class of each
checkpointed module (1st, 3rd, ...), counted in forward order; :data:`TORCHTITAN_OP_SAVE_OPS` is
torchtitan's policy. torchtitan counts ``aten.mm`` only and never keeps ``addmm`` / ``bmm``; the matmul
class holds all three, so the two agree on models whose linear layers have no bias (Llama). This
module's default (:data:`DEFAULT_SAVE_OPS`) saves every matmul and attention output: more memory, less
recompute than torchtitan's. In a Llama 3 block (wq, wk, wv, wo, w1, w3, w2) torchtitan's rule
recomputes wk, wo and w3: 37% of the block's matmul FLOPs at 8B.
"""

from __future__ import annotations

SELECTIVE = "selective"
# Forward op classes whose outputs a selective policy may keep (cost/kernels.py OP_CLASSES without the
# attention and convolution backward, which run in backward only).
ALTERNATE_MATMUL = "alternate_matmul"  # the odd-numbered matmuls of a region ([Note: torchtitan's op-level policy])
SAVEABLE_OP_CLASSES = ("matmul", "grouped_matmul", "attention_fwd", "conv_fwd", "elementwise", "reduction", "copy",
                       "embedding", "loss", "other", ALTERNATE_MATMUL)
DEFAULT_SAVE_OPS = ("matmul", "attention_fwd")  # [Note: torchtitan's op-level policy]
TORCHTITAN_OP_SAVE_OPS = (ALTERNATE_MATMUL, "attention_fwd")  # torchtitan's selective_ac_option = "op"


def keeps_alternate_matmuls(save_ops: tuple[str, ...]) -> bool:
    """Whether ``save_ops`` keeps every other matmul only (``"alternate_matmul"`` without ``"matmul"``)."""
    return ALTERNATE_MATMUL in save_ops and "matmul" not in save_ops


def ac_mode(activation_checkpoint: bool | str) -> str:
    """``"none"``, ``"full"`` or ``"selective"`` for a unit's ``activation_checkpoint`` value."""
    if activation_checkpoint == SELECTIVE:
        return "selective"
    return "full" if activation_checkpoint is True else "none"


def is_selective(activation_checkpoint: bool | str) -> bool:
    return activation_checkpoint == SELECTIVE


# [Note: No checkpointing of a forward that builds a cache] The one rule that follows from
# shard_planner/trace/cache.py ([Note: A forward that builds a cache]): a model whose forward returns a
# cache for a later call (``ModelTrace.forward_cache``) is never checkpointed, neither fully nor
# selectively: the solver offers no checkpointing for it and a plan that checkpoints it is refused
# before it is estimated or run. Training does not read the cache, so building the model without one
# allows checkpointing again.
USE_CACHE_FIX = 'build the model with use_cache=False (in a config.json: "use_cache": false)'


def checkpointing_refusal(model: str, forward_cache: str | None) -> str | None:
    """Why no unit of ``model`` may be checkpointed (one line that names the fix), or None when it may.
    See [Note: No checkpointing of a forward that builds a cache]."""
    if forward_cache is None:
        return None
    return (f"{model}: its forward returns a cache ({forward_cache}) that activation checkpointing's "
            f"recomputation would extend again (selective checkpointing fails on it in backward); "
            f"{USE_CACHE_FIX} to allow checkpointing")


def check_checkpointing_allowed(units, model: str, forward_cache: str | None) -> None:
    """Raise PlanError when one of ``units`` (plan.Unit) checkpoints a model that may not be
    (:func:`checkpointing_refusal`)."""
    refusal = checkpointing_refusal(model, forward_cache)
    checkpointed = [u.name for u in units if u.activation_checkpoint]
    if refusal is not None and checkpointed:
        from shard_planner.errors import PlanError

        more = f" and {len(checkpointed) - 1} more" if len(checkpointed) > 1 else ""
        raise PlanError(f"the plan checkpoints {checkpointed[0]}{more}, but {refusal}")
