"""The plan's tensor-parallel styles as torch's ``ParallelStyle`` objects, for ``parallelize_module``.

    parallelize_module(model, device_mesh["tp"], torch_tp_plan(plan.tensor_parallel))

One function maps every :class:`~shard_planner.parallel.tensor_parallel.Style` to the class and layouts that
shard_planner/parallel/tensor_parallel.py [Note: The tensor-parallel styles] describes; the executor applies it
before ``fully_shard`` (execute/apply.py) and the trace's proofs use the same objects.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from shard_planner.parallel.tensor_parallel import (SEQUENCE_DIM, ModuleStyle, Style, TensorParallel,
                                                    sum_gradients_over)


# [Note: gather_input hands on a DTensor]
# The gathered input is handed to the module as a Replicate DTensor (PrepareModuleInput's default
# ``use_local_output=False``, as torchtitan's ``apply_tp`` leaves it for "attention" and "feed_forward",
# torchtitan/models/llama3/infra/parallelize.py), not as its local tensor. Each colwise projection then takes
# that DTensor as it is (ColwiseParallel._prepare_input_fn redistributes only a differing layout,
# torch/distributed/tensor/parallel/style.py), autograd sums their Partial input gradients on the one DTensor,
# and the gather's backward reduce-scatters that sum once: one reduce-scatter of (b, s, h) per gather. Handed
# the local tensor instead, every colwise projection wraps it anew with ``DTensor.from_local(..., Replicate())``,
# whose backward turns its Partial gradient into Replicate on its own: an all-reduce of (b, s, h) per
# projection (3 for wq/wk/wv, 2 for w1/w3) and no reduce-scatter. Counted at tp 2 on CPU/gloo
# (tests/execute/test_tensor_parallel_run.py, exec_llama_tp, 2 blocks): 10 all-reduces of (b, s, h) per step
# with the local tensor, 4 reduce-scatters with the DTensor. The module's own code sees a DTensor input: it may
# read its shape and hand it to the projections, which is what attention and feed-forward modules do.


def torch_style(style: ModuleStyle, tp: TensorParallel) -> ParallelStyle:
    """The ``ParallelStyle`` for one module's style under ``tp``'s sequence / loss parallelism."""
    between = Shard(SEQUENCE_DIM) if tp.sequence_parallel else Replicate()  # activations between split regions
    s = style.style
    if s is Style.COLWISE:
        return ColwiseParallel()
    if s is Style.ROWWISE:
        return RowwiseParallel(output_layouts=between)
    if s is Style.EMBEDDING:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if s is Style.HEAD:
        return ColwiseParallel(input_layouts=between, output_layouts=Shard(-1) if tp.loss_parallel else Replicate(),
                               use_local_output=not tp.loss_parallel)
    if s is Style.NORM:
        return SequenceParallel(sequence_dim=SEQUENCE_DIM)
    if s is Style.GATHER_INPUT:
        if style.kwarg is not None:  # See [Note: gather_input hands on a DTensor]
            return PrepareModuleInput(input_kwarg_layouts={style.kwarg: Shard(SEQUENCE_DIM)},
                                      desired_input_kwarg_layouts={style.kwarg: Replicate()}, use_local_output=False)
        return GatherFirstInput()
    if s is Style.GRAD_ALL_REDUCE:
        return GradAllReduce()
    raise AssertionError(f"unhandled tensor-parallel style {s}")


class GatherFirstInput(ParallelStyle):
    """``PrepareModuleInput(input_layouts=(Shard(1), None, ...), desired_input_layouts=(Replicate(), None, ...))``
    for a module called with any number of positional arguments: torch's class needs one layout per
    positional argument (it raises "module inputs and input_layouts should have same length!"), which depends
    on the model's code, so the first argument's redistribution is done here with the same DTensor calls
    (``from_local`` on Shard(1), ``redistribute`` to Replicate: an all-gather whose backward is a
    reduce-scatter), the rest passed through. See [Note: gather_input hands on a DTensor]."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_mod, args, kwargs):
            if not args or not isinstance(args[0], torch.Tensor):
                raise TypeError(f"gather_input: {type(module).__name__} was called without a tensor as its first "
                                "positional argument; name the gathered keyword argument (gather_input:NAME)")
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(SEQUENCE_DIM),), run_check=False)
            return (x.redistribute(placements=(Replicate(),)), *args[1:]), kwargs  # a DTensor, not its local

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


class GradAllReduce(ParallelStyle):
    """transformers' ``ReplicatedWithGradAllReduce`` (transformers/distributed/tensor_parallel.py): the module's
    parameters stay whole plain tensors on every tp rank, and each one's gradient, which covers this rank's share of
    the split axis only (Qwen3's per-head norms), is summed over the tp group once autograd has accumulated it. The
    hook is put on the parameters the forward sees (FSDP2's unsharded ones, registered while it runs), as
    transformers puts it, and the sum is a functional all-reduce, counted with DTensor's collectives
    (execute/comm_count.py [Note: counting tensor parallelism's collectives])."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sum_gradients_over(module, device_mesh.get_group())
        return module


def torch_tp_plan(tp: TensorParallel) -> dict[str, ParallelStyle]:
    """``parallelize_module``'s plan: module fqn -> ``ParallelStyle``."""
    return {fqn: torch_style(style, tp) for fqn, style in tp.styles_by_fqn.items()}
