"""One training step of a run: the model file's synthetic batches, forward, loss, backward, optimizer.

The pieces a run is made of (also used by the tests' single-process reference): :func:`make_optimizer`,
:func:`make_step_batch`, :func:`build_on_device`, and :class:`Stepper`, which execute/worker.py calls once
per step.

[Note: the micro-batch of a data-parallel rank]
The batch of step s is drawn with seed ``SEED + 1000 * s + d`` where d is the rank's *data-parallel* rank
(execute/apply.py ``data_rank``: its coordinate on the dp sub-mesh), so that a single process can replay the
same global batch (the tests do). Without tensor parallelism d is the global rank, as before it. The tp ranks
of one data-parallel group share d, hence their micro-batch: tensor parallelism splits one micro-batch's
computation, it does not take a batch of its own (parallel/mesh.py [Note: which size means what], ``dp_size``).

[Note: loss parallelism in a step]
With ``tensor_parallel.loss_parallel`` the output layer hands its logits on as a DTensor split on the
vocabulary (execute/tensor_parallel.py, ``head``), and the forward, the loss and the backward run inside
``torch.distributed.tensor.parallel.loss_parallel()``, as torchtitan's train step does
(torchtitan/distributed/utils.py ``get_train_context``), because torch implements only a cross-entropy over
such logits (its custom handlers for ``aten._log_softmax`` and ``aten.nll_loss_forward`` and their backwards,
torch/distributed/tensor/parallel/loss.py:31-60; "Currently only the cross-entropy loss is supported"). The
first step checks that the loss really is one: a nll_loss on a DTensor must run (:class:`_DTensorOps`); else,
or when the loss fails on the DTensor, the run stops with one line saying to set loss_parallel false. The
loss is then a replicated DTensor; its value is read with ``full_tensor()`` (no collective for Replicate).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from shard_planner.errors import RunError, first_line
from shard_planner.execute.accumulate import batch_index, set_micro_step
from shard_planner.execute.memtrack import StorageTracker
from shard_planner.model.modelfile import ModelFile, map_inputs
from shard_planner.plan import OPTIMIZER_TORCH, Plan, Training

logger = logging.getLogger(__name__)

SEED = 1234
_NLL_LOSS = ("nll_loss_forward", "nll_loss2d_forward")  # what F.cross_entropy runs after _log_softmax


def make_optimizer(plan: Plan, params) -> torch.optim.Optimizer:
    """The plan's optimizer over the trainable ones of ``params`` (a fine-tune's frozen base has no state,
    as the cost model prices it); the hyper-parameters that the plan does not carry are PyTorch defaults.
    With ``training.optimizer_in_backward``: :class:`InBackwardOptimizers`."""
    if plan.training.optimizer not in OPTIMIZER_TORCH:
        raise RunError(f"unknown optimizer {plan.training.optimizer!r}")
    cls, kwargs = OPTIMIZER_TORCH[plan.training.optimizer]
    trainable = [p for p in params if p.requires_grad]
    if plan.training.optimizer_in_backward:
        return InBackwardOptimizers(getattr(torch.optim, cls), trainable, lr=plan.training.lr, **kwargs)
    return getattr(torch.optim, cls)(trainable, lr=plan.training.lr, **kwargs)


class InBackwardOptimizers(list):
    """The optimizer in backward (cost/engines/single.py [Note: Optimizer in backward]; PyTorch's tutorial
    "How to save memory by fusing the optimizer step into the backward pass"): one optimizer per parameter
    (the single-tensor path: ``foreach=False``), stepped by the parameter's post-accumulate-grad hook, which
    then frees the gradient. A list of those optimizers, so that the checkpoint (``get_state_dict`` takes an
    iterable of optimizers) and the storage tracker see every state; ``step`` and ``zero_grad`` have nothing
    left to do."""

    def __init__(self, cls, params, **kwargs):
        super().__init__(cls([p], foreach=False, **kwargs) for p in params)
        for p, opt in zip(params, self):
            p.register_post_accumulate_grad_hook(functools.partial(self._step, opt))

    @staticmethod
    def _step(opt, param) -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Every parameter was stepped in the backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every gradient was freed in the backward."""


def make_step_batch(model_file: ModelFile, micro_batch: int, step: int, data_rank: int, device: torch.device):
    """The synthetic batch of ``step`` on data-parallel rank ``data_rank`` (seeded, so any process can replay
    it). See [Note: the micro-batch of a data-parallel rank]."""
    torch.manual_seed(SEED + 1000 * step + data_rank)
    inputs, targets = model_file.batch(micro_batch)
    return map_inputs(inputs, lambda t: t.to(device)), (targets.to(device) if targets is not None else None)


def build_on_device(model_file: ModelFile, device: torch.device) -> torch.nn.Module:
    """Build the model directly on ``device``, seeded: every rank (and a reference run) gets the same
    initial weights."""
    torch.manual_seed(SEED)
    with torch.device(device):
        return model_file.build()


class _DTensorOps(TorchDispatchMode):
    """The names of the aten operators run on DTensors while active (DTensor then runs each itself)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.names.add(getattr(func, "_opname", str(func)))
            return NotImplemented
        return func(*args, **(kwargs or {}))


class Stepper:
    """One optimizer step ``s``: zero_grad, then per micro-step (``training.accumulation_steps``, see
    execute/accumulate.py) its synthetic batch, forward + loss, backward; then the optimizer step.
    Returns the loss (the micro-steps' mean). While ``tracker`` is set it is told the phase (forward /
    backward / optimizer). ``loss_parallel``: see [Note: loss parallelism in a step]."""

    def __init__(self, model_file, model, optimizer, training: Training, data_rank: int, device: torch.device,
                 loss_parallel: bool = False):
        self.model_file, self.model, self.optimizer = model_file, model, optimizer
        self.training, self.micro_batch, self.data_rank, self.device = training, training.micro_batch, data_rank, device
        self.loss_parallel, self._loss_checked = loss_parallel, not loss_parallel
        self.tracker: StorageTracker | None = None
        self.batch_fn = None  # batch index -> (inputs, targets) instead of make_step_batch (a restore)

    def _phase(self, name: str) -> None:
        if self.tracker is not None:
            self.tracker.phase = name

    def __call__(self, s: int) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        n = self.training.accumulation_steps
        losses = [self._micro_step(s, m) for m in range(n)]
        self._phase("optimizer")
        self.optimizer.step()
        return losses[0] if n == 1 else torch.stack(losses).mean()

    def _micro_step(self, s: int, m: int) -> torch.Tensor:
        set_micro_step(self.model, self.training, m)
        index = batch_index(self.training, s, m)
        if self.batch_fn is not None:  # a restore at another world size: the same global micro-batch regrouped
            inputs, targets = self.batch_fn(index)
        else:
            inputs, targets = make_step_batch(self.model_file, self.micro_batch, index, self.data_rank, self.device)
        stored = self.training.stored_dtype
        if stored is not None:  # the single-device step: floating inputs in the model's dtype, as FSDP2's root
            dtype = getattr(torch, stored)  # casts them (MixedPrecisionPolicy.cast_forward_inputs)
            inputs = map_inputs(inputs, lambda t: t.to(dtype) if t.is_floating_point() else t)
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            self._phase("forward")
            loss = self._forward_and_loss(inputs, targets)
            self._phase("backward")
            n = self.training.accumulation_steps
            (loss if n == 1 else loss / n).backward()  # a mean over the global batch: execute/accumulate.py
        loss = loss.detach()
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def _forward_and_loss(self, inputs, targets) -> torch.Tensor:
        if self._loss_checked:
            return self.model_file.loss(self.model_file.forward(self.model, inputs, targets), targets)
        hint = "set tensor_parallel.loss_parallel false in the plan"
        ops = _DTensorOps()
        with ops:  # a transformers model given its labels computes its loss in forward
            output = self.model_file.forward(self.model, inputs, targets)
        try:
            with ops:
                loss = self.model_file.loss(output, targets)
        except Exception as exc:
            raise RunError(f"loss parallelism: the loss failed on the output layer's vocabulary-split logits "
                           f"({type(exc).__name__}: {first_line(exc)}); torch supports only a cross-entropy there: "
                           f"{hint}") from exc
        if not ops.names.intersection(_NLL_LOSS):
            raise RunError(f"loss parallelism: {self.model_file.path}'s loss is not a cross-entropy over the logits "
                           f"(no nll_loss ran on them), the only loss torch computes on vocabulary-split logits: {hint}")
        self._loss_checked = True
        return loss
