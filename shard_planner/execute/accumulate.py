"""Gradient accumulation in a run: the FSDP2 switches of each micro-step of one optimizer step.

A plan with ``training.accumulation_steps = n`` trains n micro-steps of ``micro_batch`` samples per
rank, then steps the optimizer once (execute/stepper.py's ``Stepper``). Each micro-step's loss is
scaled by 1/n before its backward, so the accumulated gradient of a mean-reduced loss equals that of
one batch n times as large. Between micro-steps (cost/accumulation.py models the same):

- ``gradient_sync = "last_micro_step"``: ``set_requires_gradient_sync(False)`` on micro-steps 1..n-1
  (no reduce-scatter; unsharded gradients held), True on the last;
- ``keep_params_gathered``: ``set_reshard_after_backward(False)`` on micro-steps 1..n-1 (the next
  forward finds the parameters gathered), True on the last so the optimizer steps sharded parameters.

The micro-batch of micro-step m of step s is the one ``make_step_batch`` draws for index ``s x n + m``
(the step itself when n = 1), so a single process can replay the global batch.
"""

from __future__ import annotations

import logging

from torch.distributed.fsdp import FSDPModule

from shard_planner.plan import GRADIENT_SYNCS, Training

logger = logging.getLogger(__name__)


def batch_index(training: Training, step: int, micro_step: int) -> int:
    """Which synthetic batch micro-step ``micro_step`` of ``step`` trains on (see the module docstring)."""
    return step * training.accumulation_steps + micro_step


def set_micro_step(model: FSDPModule, training: Training, micro_step: int) -> None:
    """Set FSDP2's gradient sync and reshard-after-backward for micro-step ``micro_step`` (0-based) on
    every unit of ``model`` (the root); nothing without accumulation, nor on one device without FSDP2
    (plan/engine.py: autograd adds each micro-step's gradients into ``.grad``)."""
    n = training.accumulation_steps
    if n == 1 or not hasattr(model, "set_requires_gradient_sync"):  # no FSDP2: the single-device step
        return
    last = micro_step == n - 1
    model.set_requires_gradient_sync(last or training.gradient_sync == GRADIENT_SYNCS[0], recurse=True)
    model.set_reshard_after_backward(last or not training.keep_params_gathered, recurse=True)
