"""Gradient accumulation in the exports: what each training stack is told of a plan's micro-steps.

A plan with ``training.accumulation_steps = n > 1`` trains n micro-steps of ``micro_batch`` per GPU per
optimizer step (global batch = micro-batch x n x GPUs), reduce-scattering gradients every micro-step or
only on the last (``gradient_sync``), with parameters kept gathered between micro-steps or not
(``keep_params_gathered``); shard_planner/execute/accumulate.py runs exactly that. The stacks:

- FSDP2 (:func:`fsdp2_train_step_source`): a ``train_step`` that sets ``set_requires_gradient_sync`` and
  ``set_reshard_after_backward`` per micro-step as the executor does, and scales each loss by 1/n;
- Accelerate: ``Accelerator(gradient_accumulation_steps=n)`` (or ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``)
  with each micro-step inside ``accelerator.accumulate(model)``, which skips gradient synchronisation on
  all but the last micro-step (Accelerate's gradient-accumulation guide), or
  ``GradientAccumulationPlugin(num_steps=n, sync_each_batch=True)`` to sync every micro-step (Accelerate's
  API reference); no setting keeps parameters gathered;
- DeepSpeed: ``gradient_accumulation_steps`` and ``train_batch_size``; ZeRO-3 reduces every micro-step's
  gradients into its partitions (it has no deferred sync), so a deferred plan is noted;
- torchtitan: ``[training] global_batch_size`` with ``local_batch_size`` (torchtitan derives the steps as
  global / (local x data-parallel degree), torchtitan/train.py); its ``train_step`` reduce-scatters every
  micro-step and reshards after backward, so the other policies are noted.
"""

from __future__ import annotations

from shard_planner.plan import GRADIENT_SYNCS, Plan


def deferred(plan: Plan) -> bool:
    return plan.training.accumulation_steps > 1 and plan.training.gradient_sync != GRADIENT_SYNCS[0]


def kept(plan: Plan) -> bool:
    return plan.training.accumulation_steps > 1 and plan.training.keep_params_gathered


def policy_notes(plan: Plan, where: str, *, syncs_every_step: bool, fsdp2: bool = True) -> list[str]:
    """Notes for what ``where`` cannot say of the plan's accumulation policies. ``syncs_every_step``: the
    stack reduces gradients every micro-step whatever it is told; ``fsdp2``: it runs FSDP2 underneath (a
    training loop can call FSDP2's setter itself)."""
    notes = []
    if syncs_every_step and deferred(plan):
        notes.append(f"the plan reduce-scatters gradients on the last micro-step only; {where} reduces them every "
                     "micro-step: more communication and less gradient memory than the plan")
    if kept(plan):
        call = "call it on the model in your loop, or " if fsdp2 else ""
        notes.append(f"the plan keeps parameters gathered between micro-steps (FSDP2 set_reshard_after_backward(False) "
                     f"on all but the last); {where} has no setting for it: {call}expect one more all-gather per "
                     "unit per micro-step and less memory than the plan")
    return notes


def accelerate_lines(plan: Plan) -> list[str]:
    """Header lines of the Accelerate config: how to train the plan's micro-steps ([] without accumulation)."""
    t = plan.training
    if t.accumulation_steps == 1:
        return []
    n = t.accumulation_steps
    if deferred(plan):  # accumulate() skips the sync of all but the last micro-step by default
        how = (f"Accelerator(gradient_accumulation_steps={n}) (or ACCELERATE_GRADIENT_ACCUMULATION_STEPS={n}); "
               "accumulate() then syncs gradients on the last micro-step only, as planned.")
    else:  # GradientAccumulationPlugin(sync_each_batch=True): sync every micro-step
        how = (f"Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps={n}, "
               "sync_each_batch=True)): the plan syncs gradients every micro-step.")
    return [f"Gradient accumulation: {plan.accumulation_text}.",
            f"Run each micro-step inside `with accelerator.accumulate(model):` with {how}"]


def fsdp2_train_step_source(plan: Plan) -> str:
    """Python source appended to the FSDP2 export: the plan's optimizer step over its micro-steps ("" without
    accumulation)."""
    t = plan.training
    if t.accumulation_steps == 1:
        return ""
    every = t.gradient_sync == GRADIENT_SYNCS[0]
    loss_lines = _LOSS_LINES if plan.tensor_parallel is None else _TP_LOSS_LINES
    return f'''

# Gradient accumulation: {plan.accumulation_text}.
ACCUMULATION_STEPS = {t.accumulation_steps}
SYNC_EVERY_MICRO_STEP = {every}  # False: reduce-scatter gradients on the last micro-step only
KEEP_PARAMS_GATHERED = {t.keep_params_gathered}  # True: no reshard after backward between micro-steps


def train_step(model, optimizer, micro_batches, loss_fn) -> torch.Tensor:
    """One optimizer step over ACCUMULATION_STEPS (inputs, targets) micro-batches, as planned; the mean loss."""
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for i, (inputs, targets) in enumerate(micro_batches):
        last = i == ACCUMULATION_STEPS - 1
        model.set_requires_gradient_sync(last or SYNC_EVERY_MICRO_STEP, recurse=True)
        model.set_reshard_after_backward(last or not KEEP_PARAMS_GATHERED, recurse=True)
{loss_lines}        losses.append(loss.detach())
    optimizer.step()
    return torch.stack(losses).mean()
'''


_LOSS_LINES = """        loss = loss_fn(model(inputs), targets)
        (loss / ACCUMULATION_STEPS).backward()  # a mean over the global batch
"""
# With tensor parallelism the loss and its backward run in the snippet's loss_context() (report/export/fsdp2_tp.py)
_TP_LOSS_LINES = """        with loss_context():  # torch's loss_parallel() when the logits stay split on the vocabulary
            loss = loss_fn(model(inputs), targets)
            (loss / ACCUMULATION_STEPS).backward()  # a mean over the global batch
"""
