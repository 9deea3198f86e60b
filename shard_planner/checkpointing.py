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
(torchtitan/models/llama3/infra/parallelize.py, ``_save_list``) saves the outputs of ``aten.mm``,
the SDPA kernels (flash, efficient, cuDNN) and the reduce-scatter of tensor parallelism, and recomputes
every second ``mm`` of a block (an ``mm`` counter); this module's default saves every matmul and
attention output (:data:`DEFAULT_SAVE_OPS`): at most the memory of torchtitan's policy and no more
recompute than it.
"""

from __future__ import annotations

SELECTIVE = "selective"
# Forward op classes whose outputs a selective policy may keep (cost/kernels.py OP_CLASSES without the
# attention backward, which runs in backward only).
SAVEABLE_OP_CLASSES = ("matmul", "grouped_matmul", "attention_fwd", "elementwise", "reduction", "copy",
                       "embedding", "loss", "other")
DEFAULT_SAVE_OPS = ("matmul", "attention_fwd")  # [Note: torchtitan's op-level policy]


def ac_mode(activation_checkpoint: bool | str) -> str:
    """``"none"``, ``"full"`` or ``"selective"`` for a unit's ``activation_checkpoint`` value."""
    if activation_checkpoint == SELECTIVE:
        return "selective"
    return "full" if activation_checkpoint is True else "none"


def is_selective(activation_checkpoint: bool | str) -> bool:
    return activation_checkpoint == SELECTIVE
