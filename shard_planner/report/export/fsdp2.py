"""Export a plan as a short Python function that applies it with plain FSDP2 calls.

The generated file imports only torch: users who will not depend on shard-planner in training paste it
next to their model. It does exactly what ``shard_planner.execute.apply_plan`` does (checked in
tests/test_export.py by comparing ``describe_sharding`` of both): checkpointing by replacing a module's
``forward`` with a ``torch.utils.checkpoint`` call (no wrapper module, so names stay those of the plan),
``fully_shard`` per unit (a list for a grouped unit) deepest first and the root last, each unit's
reshard policy, the ``MixedPrecisionPolicy``, CPU offload, 0-d parameters kept out of sharding
(``ignored_params``, replicated with averaged gradients, as apply_plan's [Note: 0-d parameters]), and the
prefetch lists (forward order: the
root, then the units; backward order: the units reversed).

Runs of similar units are written as list comprehensions (``for i in range(0, 32)``) so an 80-layer
plan stays a screenful.
"""

from __future__ import annotations

import json
import string
import textwrap
from dataclasses import dataclass

from shard_planner import __version__
from shard_planner.plan.checkpointing import ALTERNATE_MATMUL, keeps_alternate_matmuls
from shard_planner.plan import Plan, Unit
from shard_planner.report.export.accumulation import fsdp2_train_step_source
from shard_planner.report.export.common import (
    TEMPLATE_SAFE, TORCH_DTYPES, allocator_line, finetune_recipe, loss_paragraph, optimizer_call, py_str, split_number,
)
from shard_planner.report.export.fsdp2_tp import tp_source
from shard_planner.units import format_bytes

@dataclass(frozen=True)
class _Entry:
    """One unit as a template: module k is prefix + (base + offsets[k]) + suffix."""

    templates: tuple[tuple[str, int, str], ...]  # (prefix, offset from base, suffix) per module
    base: int
    reshard: bool | int
    checkpoint: bool | str  # "selective" too


def _as_entry(unit: Unit) -> _Entry | None:
    """None for a unit that stays literal: the root, a module without a number, or a name whose text an
    f-string template could not hold as it is (quotes, braces, backslashes)."""
    parsed = [split_number(m) for m in unit.modules]
    if unit.is_root or any(p is None for p in parsed) or not all(TEMPLATE_SAFE.fullmatch(m) for m in unit.modules):
        return None
    base = parsed[0][1]
    return _Entry(tuple((p[0], p[1] - base, p[2]) for p in parsed), base, unit.reshard_after_forward,
                  unit.activation_checkpoint)


def _literal(unit: Unit) -> str:
    names = ", ".join(py_str(m) for m in unit.modules)
    return f"([{names}], {unit.reshard_after_forward!r}, {unit.activation_checkpoint!r}),"


def _period_expr(flags: list[bool | str], index: str) -> str | None:
    """A Python condition on ``index`` (0, 1, 2, ... along the run) that is True exactly at ``flags``; for
    flags that are all ``"selective"``, that string (a run mixing it with others stays literal)."""
    if any(isinstance(f, str) for f in flags):
        return repr(flags[0]) if all(f == flags[0] for f in flags) else None
    if all(flags):
        return "True"
    if not any(flags):
        return "False"
    for period in range(2, len(flags) // 2 + 1):
        if all(flags[j] == flags[j % period] for j in range(len(flags))):
            hits = [j for j in range(period) if flags[j]]
            cond = f"== {hits[0]}" if len(hits) == 1 else f"in {{{', '.join(map(str, hits))}}}"
            return f"{index} % {period} {cond}"
    return None


def _comprehension(entries: list[_Entry]) -> str:
    first = entries[0]
    start, stride = first.base, entries[1].base - first.base
    stop = entries[-1].base + stride
    names = ", ".join(f'f"{p}{{i{f" + {o}" if o else ""}}}{s}"' for p, o, s in first.templates)
    # k: the position along the run (0, 1, 2, ...), for a checkpointing pattern such as every other unit
    k = {(True, True): "i", (False, True): f"(i - {start})", (True, False): f"i // {stride}"}.get(
        (start == 0, stride == 1), f"(i - {start}) // {stride}")
    cond = _period_expr([e.checkpoint for e in entries], k)
    rng = f"range({start}, {stop})" if stride == 1 else f"range({start}, {stop}, {stride})"
    return f"*[([{names}], {first.reshard!r}, {cond}) for i in {rng}],"


def _same_shape(a: _Entry | None, b: _Entry | None) -> bool:
    return a is not None and b is not None and a.templates == b.templates and a.reshard == b.reshard


def _units_source(plan: Plan) -> list[str]:
    """The lines of the UNITS list: literal tuples, with runs of 3+ units that differ only by a regular
    step in their number (and a periodic checkpointing pattern) folded into a comprehension."""
    units = list(plan.units)
    entries = [_as_entry(u) for u in units]
    lines: list[str] = []
    i = 0
    while i < len(units):
        j = i + 1
        if j < len(units) and _same_shape(entries[i], entries[j]) and entries[j].base > entries[i].base:
            stride = entries[j].base - entries[i].base
            while (j < len(units) and _same_shape(entries[i], entries[j])
                   and entries[j].base - entries[j - 1].base == stride):
                j += 1
        run = entries[i:j]
        if len(run) >= 3 and _period_expr([e.checkpoint for e in run], "i") is not None:
            lines.append(_comprehension(run))
        else:
            lines.extend(_literal(u) for u in units[i:j])
        i = j
    return lines


def _finetune_text(plan: Plan) -> str:
    """The docstring's paragraph on the plan's fine-tune (report/export/common.py ``finetune_recipe``)."""
    recipe = finetune_recipe(plan)
    if recipe is None:
        return ""
    return (f"\nThe plan is a fine-tune ({plan.model.finetune.text}): build_model() is the model file's, then {recipe}. "
            "The optimizer below steps only the parameters that train (those with requires_grad).")


def export_fsdp2(plan: Plan) -> str:
    """The Python source of ``apply_sharding(model, mesh)`` for ``plan``."""
    t = plan.training
    mesh_shape = repr(plan.mesh.device_mesh_shape)  # the mesh execute.apply.build_mesh builds: (8,) or (2, 8)
    mesh_names = repr(plan.mesh.device_mesh_dim_names).replace("'", '"')
    predicted = ""
    if plan.predicted is not None:
        predicted = (f"\nPredicted by shard-planner: peak {format_bytes(plan.predicted.peak_bytes)} per GPU (budget "
                     f"{format_bytes(plan.cluster.mem_budget_bytes)}), "
                     f"{'optimizer step' if t.accumulation_steps > 1 else 'step'} {plan.predicted.step_time_s:.4g} s at "
                     f"micro-batch {t.micro_batch} per GPU.")
    units = "\n".join("    " + line for line in _units_source(plan))
    fsdp_imports = ("CPUOffloadPolicy, " if t.cpu_offload else "") + "MixedPrecisionPolicy, fully_shard"
    offload = ""
    if t.cpu_offload:
        offload = ('\n    # Sharded parameters, gradients and optimizer states live on the host; pinned memory needs'
                   '\n    # an accelerator.\n    policy["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")')
    return _SOURCE.substitute(
        **checkpoint_source(plan), **tp_source(plan),
        model_path=py_str(plan.model.path), gpus=plan.cluster.gpus, version=__version__,
        fingerprint=plan.model.fingerprint, predicted=predicted, mesh_shape=mesh_shape, mesh_names=mesh_names,
        optimizer=optimizer_call(t, plan.model.finetune is not None), fsdp_imports=fsdp_imports,
        finetune=_finetune_text(plan) + loss_paragraph(plan), units=units, forward=plan.prefetch.forward,
        backward=plan.prefetch.backward, offload=offload,
        **{k: TORCH_DTYPES[v] for k, v in t.numerics.mixed_precision().items()},  # param_dtype, reduce_dtype
        allocator=textwrap.fill(allocator_line(plan, "torchrun ..."), 100, subsequent_indent="    "),
    ) + fsdp2_train_step_source(plan)  # gradient accumulation: report/export/accumulation.py


# The generated file (string.Template: $name is filled in by export_fsdp2). It imports only torch, so its
# prefetch loops write out cost/fsdp2_rules.py's ``explicit_prefetch`` over execute/apply.py's
# ``prefetch_orders``; tests/report/test_export_rules.py checks them against both.
_SOURCE = string.Template('''"""FSDP2 sharding for the model file MODEL_PATH on $gpus GPUs, generated by shard-planner $version.

Model fingerprint $fingerprint: build the model exactly as the plan's model file does.$finetune$predicted

$allocator

Usage, in every rank after init_process_group:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", $mesh_shape, mesh_dim_names=$mesh_names)
    model = apply_sharding(build_model(), mesh)
    optimizer = $optimizer$tp_usage
"""

import functools

import torch
from torch.distributed.fsdp import $fsdp_imports
$checkpoint_imports
$tp_imports
MODEL_PATH = $model_path  # the plan's model file
# One fully_shard call per unit, in forward order: (module names, reshard_after_forward, activation
# checkpointing). Several names in one list are one unit: one all-gather and one reduce-scatter for all.
# reshard_after_forward: True frees the gathered parameters after forward, False keeps them until
# backward, an int keeps a copy sharded over that many ranks. "" is the root module.
UNITS = [
$units
]
FORWARD_PREFETCH = $forward  # all-gathers issued this many units ahead in forward (0: FSDP2's default)
BACKWARD_PREFETCH = $backward  # ... and in backward (FSDP2 prefetches 1 by default)


${checkpoint_source}${tp_source}def _depth(name: str) -> int:
    return 0 if name == "" else name.count(".") + 1


def _replicate_scalars(model: torch.nn.Module, mesh) -> set:
    """FSDP2 cannot shard 0-d parameters (CLIP's logit_scale): kept whole on every rank (ignored_params),
    their gradients averaged over the mesh by a hook."""
    def average_grad(param: torch.Tensor) -> None:
        for group in mesh.get_all_groups():  # a sum over each mesh dimension in turn: the sum over the mesh
            torch.distributed.all_reduce(param.grad, group=group)
        param.grad.div_(mesh.size())

    scalars = {p for p in model.parameters() if p.dim() == 0}
    for p in scalars:
        if p.device.type not in ("meta", mesh.device_type):
            p.data = p.data.to(torch.cuda.current_device() if mesh.device_type == "cuda" else mesh.device_type)
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(average_grad)
    return scalars


def apply_sharding(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Shard ``model`` in place as planned and return it; ``mesh`` is the plan's DeviceMesh (the usage's)."""
$tp_apply    policy = dict(mesh=$dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=$param_dtype,
                                                            reduce_dtype=$reduce_dtype))$offload
    get = model.get_submodule
    policy["ignored_params"] = _replicate_scalars(model, mesh) or None
    for names, _, checkpointed in UNITS:
        if checkpointed:
            for name in names:
                _checkpoint(get(name), checkpointed)
    # Deepest units first, so a nested unit is sharded before the unit that contains it; the root last.
    for names, reshard, _ in sorted(UNITS, key=lambda unit: _depth(unit[0][0]), reverse=True):
        modules = [get(name) for name in names]
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=reshard, **policy)
    # Prefetch: forward order is the root then the units; backward order is the units reversed.
    units = [get(names[0]) for names, _, _ in UNITS if names != [""]]
    forward, backward = [model, *units], units[::-1]
    for i, module in enumerate(forward):
        if FORWARD_PREFETCH and forward[i + 1:i + 1 + FORWARD_PREFETCH]:
            module.set_modules_to_forward_prefetch(forward[i + 1:i + 1 + FORWARD_PREFETCH])
    for i, module in enumerate(backward):
        if backward[i + 1:i + 1 + BACKWARD_PREFETCH]:
            module.set_modules_to_backward_prefetch(backward[i + 1:i + 1 + BACKWARD_PREFETCH])
    return model
''')


def _saved_ops(plan: Plan) -> tuple[str, str, str, str]:
    """The op classes the plan's selective units keep, the aten op names of those classes (the tracer's
    classification, trace/kernel_ops.py), the names of which every other one is kept (the matmuls under
    ``"alternate_matmul"``: shard_planner/plan/checkpointing.py [Note: torchtitan's op-level policy]), and a
    comment for classes no name list covers."""
    classes = sorted({c for u in plan.units if u.activation_checkpoint == "selective" for c in u.ac_save_ops})
    if not classes:
        return "none", "()", "()", ""
    from shard_planner.trace.kernel_ops import op_names_of_class  # torch: only for plans that need it

    listed = [c for c in classes if c != ALTERNATE_MATMUL]
    names = sorted({n for c in listed for n in op_names_of_class(c)})
    alternate = sorted(op_names_of_class("matmul")) if keeps_alternate_matmuls(tuple(classes)) else []
    unlisted = [c for c in listed if not op_names_of_class(c)]
    comment = (f"\n# Not listed (no fixed op names: shard-planner's executor keeps them, this file recomputes "
               f"them): {', '.join(unlisted)}." if unlisted else "")
    return (", ".join(classes), "{" + ", ".join(json.dumps(n) for n in names) + "}",
            "{" + ", ".join(json.dumps(n) for n in alternate) + "}" if alternate else "()", comment)


# How the generated file checkpoints: plans with selective units carry the op policy, others only full
# checkpointing (string.Template, filled in by _checkpoint_source).
_FULL_CHECKPOINT = '''def _checkpoint(module: torch.nn.Module, mode) -> None:
    """Activation checkpointing without a wrapper module, so module names stay those of the plan."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


'''
_SELECTIVE_CHECKPOINT = string.Template('''def _checkpoint(module: torch.nn.Module, mode) -> None:
    """Activation checkpointing without a wrapper module, so module names stay those of the plan; mode
    True: full, "selective": the outputs of SAVED_OPS are kept and every other op is recomputed."""
    forward = module.forward
    extra = {"context_fn": lambda: create_selective_checkpoint_contexts(_policy())} if mode == "selective" else {}

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = checkpointed


# Selective checkpointing keeps the outputs of these aten ops (the plan's op classes: $save_classes).$save_comment
SAVED_OPS = frozenset($saved_ops)


def _save_policy(ctx, func, *args, **kwargs):
    if not getattr(func, "is_view", False) and func._overloadpacket.__name__ in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# Of these aten ops only the 1st, 3rd, ... of each checkpointed call are kept (torchtitan's "op" rule).
ALTERNATE_OPS = frozenset($alternate_ops)


def _policy():
    """A fresh policy for one checkpointed call: it numbers the ALTERNATE_OPS it sees."""
    seen = [0]

    def policy(ctx, func, *args, **kwargs):
        if not getattr(func, "is_view", False) and func._overloadpacket.__name__ in ALTERNATE_OPS:
            seen[0] += 1
            return CheckpointPolicy.MUST_SAVE if seen[0] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return _save_policy(ctx, func, *args, **kwargs)

    return policy


''')


def checkpoint_source(plan: Plan) -> dict[str, str]:
    """The generated file's checkpoint import and ``_checkpoint`` (with ``SAVED_OPS`` and ``_save_policy``
    when some unit is selective)."""
    if not any(u.activation_checkpoint == "selective" for u in plan.units):
        return dict(checkpoint_imports="from torch.utils.checkpoint import checkpoint", checkpoint_source=_FULL_CHECKPOINT)
    save_classes, saved_ops, alternate_ops, save_comment = _saved_ops(plan)
    return dict(
        checkpoint_imports="from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts",
        checkpoint_source=_SELECTIVE_CHECKPOINT.substitute(save_classes=save_classes, saved_ops=saved_ops, alternate_ops=alternate_ops,
                                                           save_comment=save_comment))
