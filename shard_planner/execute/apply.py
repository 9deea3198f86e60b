"""Apply a plan to a model with real FSDP2: exactly what the plan says, nothing more.

Usable from any training script::

    from shard_planner.execute import apply_plan, build_mesh
    from shard_planner.plan import load_plan

    plan = load_plan("plan.json")
    mesh = build_mesh(plan, "cuda")          # 1-D (shard,) or 2-D (replicate, shard) for HSDP
    model = apply_plan(build_model(), plan, mesh)

With tensor parallelism the mesh is (..., "tp") and the plan's styles are applied first (see [Note: tensor
parallelism before FSDP2]).

Order of operations (torchtitan, torchtitan/distributed/fsdp.py, does the same):

1. check that the plan matches the model (:func:`check_plan_matches`: shard_planner/load/checked_plan.py's
   checks, as every command makes them before launching: fingerprint, every FQN, grouped modules are
   contiguous siblings, tied weights in one unit); a mismatch raises :class:`PlanError` naming what differs;
2. with tensor parallelism, ``parallelize_module`` over the mesh's "tp" dimension
   ([Note: tensor parallelism before FSDP2]);
3. activation checkpointing: the ``forward`` of every module of a checkpointed unit is replaced on the
   instance by ``torch.utils.checkpoint.checkpoint(original_forward, use_reentrant=False)`` (a
   selective unit adds ``context_fn``: execute/selective.py). This is
   what ``checkpoint_wrapper`` does, without inserting a wrapper module, so FQNs (and the plan, the
   state dict and :func:`describe_sharding`) keep their names. FSDP2's hooks run outside the
   checkpoint, as with ``checkpoint_wrapper`` applied before ``fully_shard``;
4. ``fully_shard`` on each unit (a list for a grouped unit) over the data-parallel sub-mesh, deepest
   first, the root last, each with its reshard policy, the plan's ``MixedPrecisionPolicy`` and offload
   policy, and the model's 0-d parameters left out (see [Note: 0-d parameters]);
5. explicit prefetch lists (see [Note: prefetch order]).

[Note: tensor parallelism before FSDP2]
torchtitan applies tensor parallelism, then activation checkpointing, then FSDP2
(torchtitan/models/llama3/infra/parallelize.py ``parallelize_llama``: ``apply_tp(model, world_mesh["tp"], ...)``
before ``apply_fsdp(model, world_mesh[dp_mesh_dim_names], ...)``). ``parallelize_module`` replaces the split
modules' parameters by DTensors on the 1-D tp mesh (torch/distributed/tensor/parallel/style.py,
``ColwiseParallel._partition_linear_fn``: ``distribute_tensor(..., [Shard(0)])``), and ``fully_shard`` over the
data-parallel sub-mesh then shards those DTensors' local tensors on dim 0 once more: it joins the dp and tp
meshes into one (``FSDPParam._init_sharding_spec_tp``, torch/distributed/fsdp/_fully_shard/_fsdp_param.py:488-520,
``DeviceMesh._concatenate([dp_mesh, tp_mesh])``, so both must be slices of one device mesh) and places
``_StridedShard(0)`` on the dp dimension where tp already shards dim 0 (a colwise weight), plain Shard(0) else.
apply_plan keeps torchtitan's order (the styles, then checkpointing, then FSDP2); checkpointing replaces
``forward`` on the instance, inside the styles' hooks, which run around ``__call__``.
The sub-mesh is :attr:`Mesh.dp_mesh_dim_names`: ("shard",) or, for HSDP, ("replicate", "shard").

[Note: 0-d parameters]
FSDP2 shards every parameter on dim 0 and refuses a 0-d one ("doesn't support scalar parameters"; CLIP's
``logit_scale``). apply_plan passes them to every ``fully_shard`` as ``ignored_params``: FSDP2 neither
shards, moves, casts nor reduces them. They are replicated instead, like DDP's parameters: moved to the
mesh's device, and their gradient is all-reduced over every mesh dimension and divided by the mesh size
as soon as autograd has accumulated it (a post-accumulate-grad hook), which is the mean FSDP2's
reduce-scatter gives the sharded parameters, so losses match a single process. They stay in the dtype
they were built in (no mixed-precision cast) and on the device under CPU offload. The cost model holds
them whole on every rank: parameter, gradient and optimizer states (cost/unit_bytes.py); their
all-reduce's time (one small collective per 0-d parameter and step) is not modelled.

[Note: prefetch order]
Forward order is the plan's unit order with the root first (its pre-forward runs before any other
unit's); backward order is its reverse without the root (the root is the last to finish backward and
its all-gather, when it reshards at all, is issued by its own pre-backward hook). With depth k, unit i
prefetches the next k units of the order: ``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch`` (the list is cost/fsdp2_rules.py's ``explicit_prefetch``, which the
cost model's schedule and the FSDP2 export follow too). FSDP2 always prefetches one unit in backward
when a unit's explicit backward list is empty (``FSDPState._pre_backward``), so a backward depth of 0
cannot be expressed and behaves as 1 (``effective_prefetch_depth``); it is logged.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import checkpoint

from shard_planner.load.checked_plan import check_model_matches
from shard_planner.plan.checkpointing import SELECTIVE
from shard_planner.cost import fsdp2_rules  # called through the module: a test changes a rule, every caller follows
from shard_planner.errors import PlanError
from shard_planner.execute.selective import selective_context_fn
from shard_planner.execute.tensor_parallel import torch_tp_plan
from shard_planner.plan import Plan, Unit
from shard_planner.plan.engine import SINGLE

logger = logging.getLogger(__name__)

_CHECKPOINTED = "_shard_planner_checkpointed"
_TP_APPLIED = "_shard_planner_tensor_parallel"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnitSharding(NamedTuple):
    """What FSDP2 was actually told for one unit (read back from its state, not from the plan)."""

    modules: tuple[str, ...]  # FQNs of the modules of one fully_shard call ("" is the root)
    reshard_after_forward: bool | int
    forward_prefetch: tuple[tuple[str, ...], ...]  # the units it prefetches in forward, in order
    backward_prefetch: tuple[tuple[str, ...], ...]
    activation_checkpoint: bool | str  # "selective" for selective checkpointing


# ---- checks ----
def check_plan_matches(model: nn.Module, plan: Plan) -> None:
    """Raise :class:`PlanError` saying what differs when ``plan`` was not made for ``model``: the model's
    structure as every command checks it (checked_plan.check_model_matches), and that it is not sharded yet."""
    already = [fqn for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]  # (a tp split alone is allowed)
    if already:
        raise PlanError(f"the model is already sharded (module {already[0]!r} is an FSDP module); apply a plan once")
    check_model_matches(plan, model, plan.model.path)


# ---- mesh and policies ----
def build_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The plan's mesh over the initialised default process group: 1-D ("shard",) for FSDP, 2-D
    ("replicate", "shard") for HSDP, then a last "tp" dimension with tensor parallelism
    (:attr:`Mesh.device_mesh_shape`)."""
    return init_device_mesh(device_type, plan.mesh.device_mesh_shape, mesh_dim_names=plan.mesh.device_mesh_dim_names)


def _check_mesh(mesh: DeviceMesh, plan: Plan) -> None:
    want = plan.mesh.device_mesh_shape
    if tuple(mesh.shape) != want:
        shape = "x".join(str(s) for s in mesh.shape)
        raise PlanError(f"the plan needs a mesh of shape {'x'.join(map(str, want))} "
                        f"({' x '.join(plan.mesh.device_mesh_dim_names)}), got {shape}")


def dp_mesh(mesh: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The data-parallel sub-mesh FSDP2 shards over: the mesh itself without tensor parallelism."""
    if not plan.mesh.is_tp:
        return mesh
    return mesh[plan.mesh.dp_mesh_dim_names]


def data_rank(mesh: DeviceMesh, plan: Plan) -> int:
    """This rank's index among the data-parallel ranks (its coordinate on the dp sub-mesh, row-major): the
    tp ranks of one data-parallel group share it, and so their micro-batch. The global rank without tp."""
    coordinate = mesh.get_coordinate()
    index = 0
    for name, size in zip(plan.mesh.device_mesh_dim_names, plan.mesh.device_mesh_shape):
        if name != "tp":
            index = index * size + coordinate[plan.mesh.device_mesh_dim_names.index(name)]
    return index


def mixed_precision_policy(plan: Plan) -> MixedPrecisionPolicy:
    """FSDP2's policy of the plan's numerics (plan/numerics.py ``Numerics.mixed_precision``)."""
    return MixedPrecisionPolicy(**{k: _DTYPES[v] for k, v in plan.training.numerics.mixed_precision().items()})


def offload_policy(plan: Plan, device_type: str) -> OffloadPolicy:
    if not plan.training.cpu_offload:
        return OffloadPolicy()
    # Pinned host memory needs an accelerator (DESIGN.md, "FSDP2 facts").
    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


# ---- apply ----
def _checkpoint_forward(module: nn.Module, save_ops: tuple[str, ...] = ()) -> None:
    """Full checkpointing, or selective keeping the outputs of ``save_ops`` (execute/selective.py)."""
    if getattr(module, _CHECKPOINTED, False):
        return
    original = module.forward
    extra = {"context_fn": selective_context_fn(save_ops)} if save_ops else {}

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return checkpoint(original, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward
    setattr(module, _CHECKPOINTED, SELECTIVE if save_ops else True)


def _checkpoint_of(modules) -> bool | str:
    """What checkpointing every one of ``modules`` has (False when one has none)."""
    marks = {getattr(m, _CHECKPOINTED, False) for m in modules}
    return marks.pop() if len(marks) == 1 else False


def _depth(unit: Unit) -> int:
    return 0 if unit.is_root else unit.modules[0].count(".") + 1


def apply_plan(model: nn.Module, plan: Plan, mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard ``model`` in place as ``plan`` says and return it. ``mesh``: the plan's mesh (built from
    the default process group with :func:`build_mesh` when None)."""
    check_plan_matches(model, plan)
    if plan.engine == SINGLE:
        return apply_single_device(model, plan)
    if mesh is None:
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        mesh = build_mesh(plan, "cuda" if device_type == "cuda" else "cpu")
    _check_mesh(mesh, plan)
    modules = dict(model.named_modules())

    apply_tensor_parallel(model, plan, mesh)  # See [Note: tensor parallelism before FSDP2]
    for unit in plan.units:
        if unit.activation_checkpoint:
            for fqn in unit.modules:
                _checkpoint_forward(modules[fqn], unit.ac_save_ops)

    mp = mixed_precision_policy(plan)
    offload = offload_policy(plan, mesh.device_type)
    scalars = replicate_scalar_params(model, mesh)  # See [Note: 0-d parameters]
    fsdp_mesh = dp_mesh(mesh, plan)
    # Deepest first so nested units are sharded before the units that contain them; the root last.
    for unit in sorted(plan.units, key=_depth, reverse=True):
        targets = [modules[fqn] for fqn in unit.modules]
        fully_shard(targets if len(targets) > 1 else targets[0], mesh=fsdp_mesh,
                    reshard_after_forward=unit.reshard_after_forward, mp_policy=mp, offload_policy=offload,
                    ignored_params=scalars or None)
        logger.debug("fully_shard(%s, reshard_after_forward=%s)", unit.name, unit.reshard_after_forward)

    _set_prefetch(plan, modules)
    return model


def apply_single_device(model: nn.Module, plan: Plan) -> nn.Module:
    """The single-device step (plan/engine.py; cost/engines/single.py [Note: The single-device step]): every
    floating parameter cast to ``training.stored_dtype`` in place (``param.data``: the module keeps its
    Parameter objects; non-floating ones, NF4 weights among them, and buffers stay as built), then the
    checkpointed units' modules checkpointed. No wrapper, no hooks, no process group used."""
    stored = plan.training.stored_dtype
    if stored is not None:
        dtype = _DTYPES[stored]
        for p in model.parameters():
            if type(p.data) is torch.Tensor and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    modules = dict(model.named_modules())
    for unit in plan.units:
        if unit.activation_checkpoint:
            for fqn in unit.modules:
                _checkpoint_forward(modules[fqn], unit.ac_save_ops)
    return model


def apply_tensor_parallel(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> nn.Module:
    """The plan's tensor-parallel styles over ``mesh["tp"]`` (nothing without tensor parallelism), once: a model
    already split (the run splits it first to read the local shapes FSDP2 will shard) is left as it is.
    See [Note: tensor parallelism before FSDP2]."""
    if plan.tensor_parallel is None or getattr(model, _TP_APPLIED, False):
        return model
    parallelize_module(model, mesh["tp"], torch_tp_plan(plan.tensor_parallel))
    setattr(model, _TP_APPLIED, True)
    logger.debug("parallelize_module over tp=%d: %d styles", plan.mesh.tp_size, len(plan.tensor_parallel.styles))
    return model


def replicate_scalar_params(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """The model's 0-d parameters, moved to the mesh's device, each with a hook that averages its
    gradient over the mesh once autograd has accumulated it. See [Note: 0-d parameters]."""
    scalars = {p for p in model.parameters() if p.dim() == 0}
    if not scalars:
        return scalars
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    groups, size = mesh.get_all_groups(), mesh.size()

    def average_grad(param: torch.Tensor) -> None:
        for group in groups:  # a sum over each mesh dimension in turn: the sum over the mesh
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(size)

    for p in scalars:
        if p.device.type not in ("meta", device.type):
            with torch.no_grad():
                p.data = p.data.to(device)
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(average_grad)
    logger.info("%d 0-d parameter(s) replicated on every rank, not sharded (FSDP2 cannot shard them)", len(scalars))
    return scalars


def prefetch_orders(plan: Plan) -> tuple[list[Unit], list[Unit]]:
    """(forward order, backward order) of the units for explicit prefetch; see [Note: prefetch order]."""
    inner = list(plan.inner_units)
    return [plan.root, *inner], list(reversed(inner))


def _set_prefetch(plan: Plan, modules: dict[str, nn.Module]) -> None:
    forward, backward = prefetch_orders(plan)

    def handle(unit: Unit) -> FSDPModule:
        return modules[unit.modules[0]]  # every module of a group shares the group's FSDP state

    # the lists: cost/fsdp2_rules.py ``explicit_prefetch`` ([Note: Prefetch depth and targets])
    for i, unit in enumerate(forward):
        if nxt := fsdp2_rules.explicit_prefetch(forward, i, plan.prefetch.forward):
            handle(unit).set_modules_to_forward_prefetch([handle(u) for u in nxt])
    if fsdp2_rules.effective_prefetch_depth(plan.prefetch.backward) != plan.prefetch.backward:
        logger.warning("prefetch.backward=0: FSDP2 always prefetches one unit in backward; it behaves as 1")
    for i, unit in enumerate(backward):
        if nxt := fsdp2_rules.explicit_prefetch(backward, i, plan.prefetch.backward):
            handle(unit).set_modules_to_backward_prefetch([handle(u) for u in nxt])


# ---- inspection ----
def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.13; one group before
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def _reshard_of(state) -> bool | int:
    groups = _param_groups(state)
    group = groups[0] if groups else None
    if group is None or group.post_forward_mesh_info is None:
        return False
    if group.post_forward_mesh_info is group.mesh_info or group.post_forward_mesh_info == group.mesh_info:
        return True
    return int(group.post_forward_mesh_info.shard_mesh_size)


def describe_sharding(model: nn.Module) -> list[UnitSharding]:
    """The FSDP2 units of a sharded model as FSDP2 holds them, in module (pre-)order, root first.

    A unit's reshard setting is read from its parameter group (the root's becomes False at FSDP2's lazy
    init, on the first forward, when it was None; ``apply_plan`` always passes the plan's value)."""
    fqn_of = {id(m): fqn for fqn, m in model.named_modules()}
    states, seen = [], set()
    for fqn, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if id(state) not in seen:
                seen.add(id(state))
                states.append(state)

    def names(state) -> tuple[str, ...]:
        return tuple(fqn_of[id(m)] for m in state._modules)

    return [
        UnitSharding(
            modules=names(state),
            reshard_after_forward=_reshard_of(state),
            forward_prefetch=tuple(names(s) for s in state._states_to_forward_prefetch),
            backward_prefetch=tuple(names(s) for s in state._states_to_backward_prefetch),
            activation_checkpoint=_checkpoint_of(state._modules),
        )
        for state in states
    ]
