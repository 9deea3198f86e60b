"""Load a plan and rebuild its model, checked: the one place every command that reads a plan (``run``,
``report``, ``estimate``, ``export``, and ``tune``'s and the API's launches) checks it against its model.

    plan = load_checked_plan("plan.json")   # the plan, its files resolved, checked: a one-line UserError otherwise
    model = check_plan(plan)                # the same checks of a plan in memory; its model on the meta device

[Note: A plan checked against its model]
Before any process starts and before anything is traced, a plan is checked as ``plan`` checks what it
writes, in one line each:
1. the model the plan's model file builds now (on the meta device, as the plan recorded it: a
   transformers config's task, sequence length and fine-tune) is the model the plan was made for: the same
   structural fingerprint (trace/structure.py). A model file with a size switch (the examples'
   ``SHARD_PLANNER_SIZE``) set differently from when the plan was made builds another model: every
   command says so in the same line (:func:`check_fingerprint`), where each used to fail its own way
   further on (a rank's "names modules this model does not have", a tensor-parallel style naming a module
   the model lacks, an export written for the wrong model);
2. every unit names modules the model has, a grouped unit's modules are contiguous siblings, and tied
   weights are not split over two units (:func:`check_model_matches`, which each rank's ``apply_plan``
   repeats on the real model);
3. tensor parallelism: the degree divides the GPUs per node and the GPUs (tp_degrees.check_node_degree),
   and every dimension the styles split (heads, key/value heads, MLP width, vocabulary, the sequence with
   sequence parallelism: tp_styles.check_divisible), as ``plan`` refuses a degree. A hand-edited plan
   with TP 4 on a model of 2 key/value heads is refused here, not in a reshape inside 4 ranks.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import TYPE_CHECKING

from shard_planner.errors import ModelFileError, PlanError, UserError, first_line
from shard_planner.plan.ownership import contiguous_among, owners
from shard_planner.plan import ModelRef, Plan, Unit, load_plan

if TYPE_CHECKING:
    import torch.nn as nn

SIZE_SWITCH = "SHARD_PLANNER_SIZE"  # the examples' size switch (examples/llama.py), named as the likely cause


def load_checked_plan(path: str | os.PathLike, *, model_file=None, trace=None, source: str | None = None) -> Plan:
    """The plan in the file ``path`` (:func:`shard_planner.plan.load_plan`: its files resolved), checked by
    :func:`check_plan` against its model (or ``model_file``, or ``trace`` read from ``source``); a UserError in
    one line naming the file otherwise."""
    plan = load_plan(path)
    with checked_plan_file(path):
        check_plan(plan, model_file=model_file, trace=trace, source=source)
    return plan


@contextlib.contextmanager
def checked_plan_file(path: str | os.PathLike):
    """Checks of the plan read from ``path``: a UserError raised inside names the file (``plan.json: ...``), but for
    the model file's own errors, which name the model file."""
    try:
        yield
    except ModelFileError:
        raise
    except UserError as exc:
        raise type(exc)(f"{path}: {first_line(exc)}") from None


def check_plan(plan: Plan, *, model_file=None, trace=None, source: str | None = None) -> nn.Module | None:
    """Check ``plan`` against its model ([Note: A plan checked against its model]) and return the model, built on
    the meta device. Against ``model_file`` (a :class:`~shard_planner.model.modelfile.ModelFile`: ``estimate MODEL``)
    instead of the plan's own; or against a ``trace`` (a ModelTrace read from ``source``), which stands for a
    model that need not be here: its fingerprint alone is checked, and None returned."""
    check_tp_degree(plan)
    if trace is not None:
        check_fingerprint(plan, trace.fingerprint, source or "the trace")
        return None
    if model_file is None:
        model, source = plan_model(plan.model), plan.model.path
    else:
        model, source = build_meta(model_file), model_file.path
    check_model_matches(plan, model, source)
    if plan.tensor_parallel is not None:
        from shard_planner.trace.tp_styles import check_divisible

        check_divisible(model, plan.tensor_parallel, plan.mesh.tp, seq_len=plan.model.seq_len)
    return model


def check_model_matches(plan: Plan, model: nn.Module, source: str) -> None:
    """PlanError naming what differs when ``plan`` was not made for ``model`` (built from ``source``): its
    fingerprint, the modules its units name, grouped modules that are not contiguous siblings, tied weights
    split over two units. On the meta model before launching, and in each rank on the real one
    (execute/apply.py ``check_plan_matches``)."""
    from shard_planner.trace.structure import model_fingerprint

    check_fingerprint(plan, model_fingerprint(model), source)  # first: another size lacks module names too
    modules = dict(model.named_modules())
    missing = [fqn for u in plan.units for fqn in u.modules if fqn not in modules]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise PlanError(
            f"the plan names modules this model does not have: {', '.join(repr(m) for m in missing[:3])}{more} "
            f"(plan made for {plan.model.path}, fingerprint {plan.model.fingerprint})")
    for unit in plan.units:
        if len(unit.modules) > 1:
            check_group(model, unit)
    check_ties(modules, plan)


def check_tp_degree(plan: Plan) -> None:
    """The check that needs no model: a tensor-parallel degree stays inside a node, as ``plan --tp`` requires."""
    from shard_planner.trace.tp_degrees import check_node_degree

    check_node_degree(plan.mesh.tp, plan.cluster.gpus, plan.cluster.gpus_per_node)


def check_ties(modules: dict[str, nn.Module], plan: Plan) -> None:
    """FSDP2 shards each Parameter in exactly one unit: modules registering the same Parameter object
    (tied weights) must end up in the same unit (the innermost plan unit holding the module)."""
    wrapped = {fqn: unit for unit in plan.units for fqn in unit.modules}
    registered_by: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for fqn, module in modules.items():
        for name, p in module.named_parameters(recurse=False):
            registered_by.setdefault(id(p), []).append(fqn)
            names.setdefault(id(p), f"{fqn}.{name}" if fqn else name)
    for key, fqns in registered_by.items():
        units = owners(wrapped, fqns)  # None: not wrapped at all (no root unit), stays unsharded
        if len({id(u) for u in units.values()}) > 1:
            where = ", ".join(f"{fqn!r} in unit {u.name if u is not None else '(none)'}" for fqn, u in units.items())
            raise PlanError(f"the plan splits tied weights: parameter {names[key]!r} is registered by {where}; "
                            f"FSDP2 shards a parameter in one unit only, so these modules must share a unit "
                            f"(re-run shard-planner plan)")


def _parent_and_name(fqn: str) -> tuple[str, str]:
    parent, _, name = fqn.rpartition(".")
    return parent, name


def check_group(model: nn.Module, unit: Unit) -> None:
    parents = {_parent_and_name(fqn)[0] for fqn in unit.modules}
    if len(parents) != 1:
        raise PlanError(f"unit {unit.name}: grouped modules must be siblings, but they have parents "
                        f"{sorted(repr(p) for p in parents)}")
    parent = model.get_submodule(parents.pop())
    # Contiguous as a set, in any order: the solver lists a group in call order, which can differ from
    # registration order (transformers' BertEmbeddings registers word, position, token_type embeddings and
    # calls word, token_type, position), and fully_shard([m1, m2]) runs the group's pre-forward at the first
    # of its modules to run and its post-forward after the last, whatever the order of the list.
    # Siblings without parameters (dropout, activations) do not break a group (ownership.contiguous_among).
    order = [name for name, child in parent.named_children() if any(True for _ in child.parameters())]
    names = [_parent_and_name(fqn)[1] for fqn in unit.modules]
    if not contiguous_among(order, names):
        positions = sorted(order.index(n) for n in names if n in order)
        raise PlanError(f"unit {unit.name}: grouped modules must be a contiguous run of siblings in "
                        f"registration order (siblings without parameters aside), got positions {positions}")


def check_fingerprint(plan: Plan, fingerprint: str, source: str) -> None:
    """The one line every command says when ``source`` (a model file, a config, a trace.json) is not the model
    ``plan`` was made for ([Note: A plan checked against its model])."""
    if fingerprint == plan.model.fingerprint:
        return
    size = os.environ.get(SIZE_SWITCH)
    here = f"{SIZE_SWITCH}={size}" if size is not None else f"{SIZE_SWITCH} unset"
    raise PlanError(f"{source} is not the model the plan was made for (fingerprint {fingerprint}, the plan's "
                    f"{plan.model.fingerprint}): likely a size switch in the model file, e.g. {SIZE_SWITCH}, set "
                    f"differently from when the plan was made (here: {here}), or a changed file; set it as it was "
                    "then, or re-run shard-planner plan")


def plan_model(model: ModelRef) -> nn.Module:
    """The model a plan's model section names, built on the meta device as the plan records it (a transformers
    config's task, sequence length and fine-tune); memoized, so ``run``'s checks and its launch build it once
    (seconds at 8B). Do not modify it."""
    # A model file may read the environment when it builds (the examples' size switch): part of the key.
    return _plan_model(model, frozenset(os.environ.items()))


@functools.lru_cache(maxsize=4)
def _plan_model(model: ModelRef, environment: frozenset) -> nn.Module:
    from shard_planner.model.hf import model_options
    from shard_planner.model.modelfile import load_model_file

    path = model.path
    if path.endswith(".py") and not os.path.isfile(path):
        where = "is a folder" if os.path.isdir(path) else "no such file here or beside the plan"
        raise ModelFileError(f"{path}: the plan's model file: {where}")
    return build_meta(load_model_file(path, model_options(model)))


def build_meta(model_file) -> nn.Module:
    """``model_file``'s model on the meta device: its structure and sizes, no memory."""
    import torch

    with torch.device("meta"):
        return model_file.build()


def built_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers as built (each tensor once): what a process that builds it
    for real holds before anything is sharded."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
