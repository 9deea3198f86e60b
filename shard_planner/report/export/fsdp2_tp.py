"""The FSDP2 snippet's tensor parallelism: the source that splits the plan's modules before ``fully_shard``.

    pieces = tp_source(plan)   # {"tp_imports", "tp_source", "tp_apply", "dp_mesh", "tp_usage"}; all "" but
                               # dp_mesh ("mesh") for a plan without tensor parallelism

The generated file imports only torch, so it cannot call shard_planner/execute/tensor_parallel.py
``torch_style``; it carries ``_parallel_style``, the same mapping written out (each style's class and
layouts under the plan's sequence / loss parallelism; tests/report/test_export_tp.py holds the two equal
style by style), and ``_GatherFirstInput``, the executor's ``GatherFirstInput``. ``apply_sharding`` then does
what ``execute.apply.apply_plan`` does ([Note: tensor parallelism before FSDP2] there): ``parallelize_module``
over ``mesh["tp"]``, checkpointing, then ``fully_shard`` over the data-parallel sub-mesh
(``mesh[DP_MESH_DIMS]``, :attr:`Mesh.dp_mesh_dim_names`). With loss parallelism the output layer's logits
stay a DTensor split on the vocabulary, and the loss and its backward run inside torch's ``loss_parallel()``
(as execute/stepper.py does): the snippet's ``loss_context()``.

TP_STYLES is folded like UNITS: the styles of numbered modules (``layers.{i}.attention.wq``) that repeat over
a regular run of 3 or more numbers become one dict comprehension, so an 80-layer plan stays short.
"""

from __future__ import annotations

from shard_planner.plan import Plan
from shard_planner.report.export.common import TEMPLATE_SAFE, py_str, split_number

_NONE = dict(tp_imports="", tp_source="", tp_apply="", dp_mesh="mesh", tp_usage="")


def _folded_styles(styles: dict[str, str]) -> list[str]:
    """TP_STYLES' entries: ``"name": "style",`` or ``**{f"...{i}...": "style" for i in range(a, b, s)},``."""
    runs: dict[tuple[str, str, str], list[int]] = {}
    order: list[tuple] = []
    for fqn, style in styles.items():
        parsed = split_number(fqn)
        if parsed is None or not TEMPLATE_SAFE.fullmatch(fqn) or not TEMPLATE_SAFE.fullmatch(style):
            order.append(("literal", fqn, style))
            continue
        key = (parsed[0], parsed[2], style)
        if key not in runs:
            order.append(("run", key))
        runs.setdefault(key, []).append(parsed[1])
    lines = []
    for item in order:
        if item[0] == "literal":
            lines.append(f"{py_str(item[1])}: {py_str(item[2])},")
            continue
        (prefix, suffix, style), numbers = item[1], runs[item[1]]
        step = numbers[1] - numbers[0] if len(numbers) > 1 else 0
        if len(numbers) >= 3 and step > 0 and numbers == list(range(numbers[0], numbers[-1] + 1, step)):
            rng = f"range({numbers[0]}, {numbers[-1] + 1}" + (f", {step})" if step > 1 else ")")
            lines.append(f'**{{f"{prefix}{{i}}{suffix}": "{style}" for i in {rng}}},')
        else:
            lines.extend(f'"{prefix}{n}{suffix}": "{style}",' for n in numbers)
    return lines


def tp_source(plan: Plan) -> dict[str, str]:
    """The generated file's tensor-parallel pieces for ``plan`` (substituted into fsdp2.py's template)."""
    tp = plan.tensor_parallel
    if tp is None:
        return dict(_NONE)
    styles = "\n".join("    " + line for line in _folded_styles(tp.styles))
    source = _SOURCE.replace("$styles", styles).replace("$tp_size", str(plan.mesh.tp_size)) \
        .replace("$description", tp.description).replace("$sequence_parallel", repr(tp.sequence_parallel)) \
        .replace("$loss_parallel", repr(tp.loss_parallel)).replace("$dp_dims", repr(plan.mesh.dp_mesh_dim_names).replace("'", '"'))
    usage = ("\n    # the ranks of one tp group take the same batch (they split one micro-batch's work); the loss and"
             "\n    # its backward inside loss_context() (torch's loss_parallel() with loss parallelism)"
             "\n    with loss_context():"
             "\n        loss = loss_fn(model(inputs), targets)"
             "\n        loss.backward()")
    if any(text == "grad_all_reduce" for text in tp.styles.values()):  # the executor's hook, as it is
        import inspect

        from shard_planner.parallel.tensor_parallel import sum_gradients_over

        source += "\n\n" + _GRAD_ALL_REDUCE + "\n\n" + inspect.getsource(sum_gradients_over)
    return dict(tp_imports=_IMPORTS, tp_source=source, tp_apply=_APPLY, dp_mesh="mesh[DP_MESH_DIMS]", tp_usage=usage)


_IMPORTS = '''from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel, loss_parallel,
    parallelize_module,
)
'''

_APPLY = '''    apply_tensor_parallel(model, mesh)  # the styles first, then checkpointing, then FSDP2 (torchtitan's order)
'''

# The generated file's tensor-parallel part ($name filled in by tp_source; str.replace, as the code holds "$").
_SOURCE = '''# Tensor parallelism over the mesh's "tp" dimension ($tp_size ranks; $description).
# TP_STYLES: module name -> style. colwise: ColwiseParallel; rowwise: RowwiseParallel; embedding: RowwiseParallel on the vocabulary; head: the
# output layer, ColwiseParallel; norm: SequenceParallel; gather_input: the module's input all-gathered on the
# sequence (a keyword argument after ":"); grad_all_reduce: parameters whole, gradients summed over tp.
TP_STYLES = {
$styles
}
SEQUENCE_PARALLEL = $sequence_parallel  # activations between the split regions are split on the sequence
LOSS_PARALLEL = $loss_parallel  # the logits stay split on the vocabulary into the loss (loss_context())
SEQUENCE_DIM = 1  # (batch, seq, hidden)
DP_MESH_DIMS = $dp_dims  # the data-parallel sub-mesh fully_shard shards over


def _parallel_style(text: str) -> ParallelStyle:
    """The torch ParallelStyle of one TP_STYLES entry."""
    between = Shard(SEQUENCE_DIM) if SEQUENCE_PARALLEL else Replicate()
    style, _, kwarg = text.partition(":")
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=between)
    if style == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if style == "head":
        return ColwiseParallel(input_layouts=between, output_layouts=Shard(-1) if LOSS_PARALLEL else Replicate(),
                               use_local_output=not LOSS_PARALLEL)
    if style == "norm":
        return SequenceParallel(sequence_dim=SEQUENCE_DIM)
    if style == "gather_input" and kwarg:
        return PrepareModuleInput(input_kwarg_layouts={kwarg: Shard(SEQUENCE_DIM)},
                                  desired_input_kwarg_layouts={kwarg: Replicate()}, use_local_output=False)
    if style == "gather_input":
        return _GatherFirstInput()
    if style == "grad_all_reduce":
        return _GradAllReduce()  # written below TP_STYLES only where the plan uses it
    raise ValueError(f"unknown tensor-parallel style {text!r}")


class _GatherFirstInput(ParallelStyle):
    """The first positional argument all-gathered on the sequence, handed on as a Replicate DTensor (so the
    colwise projections that read it sum their input gradients before one reduce-scatter); the other
    arguments as they are."""

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        def gather(_mod, args, kwargs):
            if not args or not isinstance(args[0], torch.Tensor):
                raise TypeError(f"gather_input: {type(module).__name__} was called without a tensor as its first "
                                "positional argument; name the gathered keyword argument (gather_input:NAME)")
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(SEQUENCE_DIM),), run_check=False)
            return (x.redistribute(placements=(Replicate(),)), *args[1:]), kwargs

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


def apply_tensor_parallel(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Split TP_STYLES' modules over mesh["tp"] (parallelize_module)."""
    parallelize_module(model, mesh["tp"], {name: _parallel_style(style) for name, style in TP_STYLES.items()})
    return model


def loss_context():
    """Where the loss and its backward run: torch's loss_parallel() when the logits stay split."""
    import contextlib

    return loss_parallel() if LOSS_PARALLEL else contextlib.nullcontext()


'''

_GRAD_ALL_REDUCE = '''class _GradAllReduce(ParallelStyle):
    """Parameters whole on every tp rank, each gradient summed over the tp group once autograd has accumulated it
    (transformers' replicated_with_grad_allreduce: Qwen3's per-head q_norm / k_norm see this rank's heads only)."""

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        sum_gradients_over(module, device_mesh.get_group())
        return module
'''
