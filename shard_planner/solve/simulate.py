"""The one place the solver calls the cost model's simulators, and turns covers into Plans.

Every plan the solver returns, every frontier point and every baseline is judged here by the full
simulators (:func:`shard_planner.cost.estimate`): when they and the linear model disagree, these
numbers win (see :mod:`shard_planner.solve.planner`).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from shard_planner.cost.types import Estimate
from shard_planner.plan import ROOT, Cluster, ModelRef, Plan, Training, Unit
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.linear import LinearModel
from shard_planner.solve.space import SearchSpace
from shard_planner.parallel.tensor_parallel import TensorParallel
from shard_planner.trace.types import ModelTrace

logger = logging.getLogger(__name__)


def simulate(trace: ModelTrace, plan: Plan, profile: HardwareProfile) -> Estimate:
    """Peak memory and step time of ``plan`` by the cost model's event simulators."""
    from shard_planner.cost import estimate  # the cost model; imported here so the solver's pure parts load without it

    return estimate(trace, plan, profile)


def cover_units(lm: LinearModel, chosen: tuple[int, ...]) -> tuple[Unit, ...]:
    """The plan's units for one cover, in forward order, the root first (reshard False: FSDP2's
    default for the root, which it keeps gathered through the step)."""
    units = [Unit((ROOT,), reshard_after_forward=False)]
    items = lm.space.items
    for k in sorted(chosen, key=lambda k: lm.space.candidates[k].start):
        c = lm.space.candidates[k]
        o = c.option
        if o.in_root:
            continue
        modules = tuple(items[i].fqn for i in range(c.start, c.stop))
        units.append(Unit(modules, reshard_after_forward=o.reshard_after_forward,
                          activation_checkpoint=o.activation_checkpoint))
        if o.nested:
            units.extend(Unit((kid,), reshard_after_forward=o.reshard_after_forward)
                         for kid in items[c.start].nested_children)
    return tuple(units)


def single_device_units(space: SearchSpace, units: tuple[Unit, ...]) -> tuple[Unit, ...]:
    """``units`` as a single-device plan writes them (plan/engine.py): there a unit is only a region that is
    checkpointed or not, so plans that checkpoint the same modules are one plan, written one way: the root, then
    every item of ``space`` its own unit (checkpointed as the unit that held it: torch.utils.checkpoint wraps
    each module of a unit on its own, execute/apply.py), nothing resharded. One segmentation for all of them
    also prices them alike: the memory walk's blocks follow the units, and a coarse block (the root of a
    transformers model, whose forward computes the loss) is priced from its whole traced rise, where the finest
    blocks are the segmentation FSDP2's runs validate. ``units`` naming a module that is no item are returned
    as they are, nothing resharded."""
    flat = [u for u in units if not u.is_root]
    held = {fqn: u for u in flat for fqn in u.modules}
    items = {it.fqn for it in space.items}
    if not set(held) <= items:
        return tuple(replace(u, reshard_after_forward=False) for u in units)
    root = next(u for u in units if u.is_root)
    out = [replace(root, reshard_after_forward=False)]
    for it in space.items:
        u = held.get(it.fqn)
        out.append(Unit((it.fqn,), False, u.activation_checkpoint, u.ac_save_ops) if u is not None
                   else Unit((it.fqn,), False))
    return tuple(out)


def make_plan(trace: ModelTrace, units: tuple[Unit, ...], choice: GlobalChoice, *, training: Training,
              cluster: Cluster, model_path: str | None = None, tensor_parallel: TensorParallel | None = None) -> Plan:
    """A plan without prediction: the decisions only; ``tensor_parallel`` the styles of the trace's degree
    (recorded when the choice's mesh is tensor-parallel)."""
    return Plan(
        model=ModelRef(path=model_path or trace.model_path, fingerprint=trace.fingerprint,
                       seq_len=trace.tokens_per_sample, loss=trace.training.get("loss")),
        cluster=cluster,
        mesh=choice.mesh,
        training=choice.training(training),
        units=units,
        prefetch=choice.prefetch,
        tensor_parallel=tensor_parallel if choice.mesh.is_tp else None,
        engine=choice.engine,
    )
