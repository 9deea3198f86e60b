"""What the program cannot express, judged by the same simulators as its plans: the recipes
(:mod:`shard_planner.plan.recipes`), the whole model as one unit, and the solver's plans with the root resharded after
forward."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from shard_planner.plan.checkpointing import checkpointing_refusal
from shard_planner.errors import PlanError
from shard_planner.parallel.mesh import Mesh
from shard_planner.plan import ROOT, FrontierPoint, Plan, Prefetch, Unit
from shard_planner.plan.engine import SINGLE
from shard_planner.solve.context import Checked, PlanContext
from shard_planner.solve.simulate import single_device_units
from shard_planner.solve.choice import GlobalChoice
from shard_planner.plan.recipes import recipe_named, recipes_for
from shard_planner.solve.request import PlanRequest
from shard_planner.trace.types import ModelTrace
from shard_planner.solve.survive import priced_step_time_s

RECIPE_METHOD = "recipe"  # Checked.method of a recipe's plan


def recipes(ctx: PlanContext, choices: Iterable[GlobalChoice]) -> list[Checked]:
    """Every recipe (:data:`shard_planner.plan.recipes.RECIPES`) at each of ``choices``, with the knobs it fixes: its units,
    its CPU offload, and FSDP2's default prefetch where its stack exposes none; the planner's knobs
    (micro-batch, accumulation, mesh, and prefetch where the recipe leaves it) are the choice's. Each
    (recipe, resulting choice) is judged once; the status is the recipe's title, the method ``"recipe"``.
    A recipe that offloads is judged only where the search may offload (a GPU profile, offload allowed). On one
    device without sharding (plan/engine.py) recipes that differ only in FSDP2's knobs (wrap, reshard) are one
    plan: the first of them stands for all (torchtitan's, whose names list its checkpointing)."""
    out, seen = [], set()
    for choice in choices:
        space = ctx.space(choice.mesh)
        for recipe, units in recipes_for(space, ctx.trace):
            if recipe.cpu_offload and not ctx.allow_offload:
                continue
            at = replace(choice, cpu_offload=recipe.cpu_offload,
                         prefetch=Prefetch() if recipe.fixes_prefetch else choice.prefetch)
            key = (recipe.name if ctx.engine != SINGLE else single_device_units(space, units), at)
            if key not in seen:
                seen.add(key)
                out.append(ctx.check_units(units, at, recipe.title, method=RECIPE_METHOD))
    return out


def recipe_plan(trace: ModelTrace, request: PlanRequest, name: str) -> Plan:
    """The recipe called ``name`` as a plan for ``trace`` (``estimate --recipe``): its units, offload and
    prefetch, with the planner's knobs as ``request`` gives them (its micro-batch, 1 when None; plain FSDP
    over every GPU's tp group, no accumulation; FSDP2's default prefetch where the recipe leaves it). No
    prediction. Raises PlanError for a recipe that checkpoints a model that may not be checkpointed."""
    recipe = recipe_named(name)
    ctx = PlanContext(trace, request)
    try:
        mesh = Mesh.fsdp(request.gpus, trace.tp_size)  # plain FSDP over every tp group
        units = recipe.units(ctx.space(mesh))
        refusal = checkpointing_refusal(trace.model_path, trace.forward_cache)
        if refusal is not None and any(u.activation_checkpoint for u in units):
            raise PlanError(f"recipe {name} checkpoints, but {refusal}")
        choice = GlobalChoice(request.micro_batch or 1, Prefetch(), mesh, recipe.cpu_offload, engine=ctx.engine)
        return ctx.check_units(units, choice, recipe.title, method=RECIPE_METHOD).plan
    finally:
        ctx.close()


def start_plans(ctx: PlanContext) -> list[Checked]:
    """The plans the request starts from (``PlanRequest.start_plans``: the degree screen's best), judged here
    at their own global choices."""
    return [ctx.check_units(p.units, GlobalChoice.of_plan(p), "the degree's screened plan", method="screen")
            for p in ctx.request.start_plans]


def root_resharded(ctx: PlanContext, found: list[Checked]) -> list[Checked]:
    """The solver's plans with the root unit resharded after forward. The program keeps the root's
    parameters (one-off modules left to it: embeddings, final norm, head) gathered all step, as FSDP2
    does by default; resharding them frees that memory between forward and backward at the cost of one
    more all-gather in backward. The simulators decide, like for every other candidate. Plans whose
    root holds no parameters of its own are skipped (the variant would be the same plan)."""
    out = []
    for c in found:
        space = ctx.space(c.choice.mesh)
        in_root = any(space.candidates[k].option.in_root for k in c.cover or ())
        if c.method != "cp-sat" or not (space.root_only_params or in_root):
            continue
        units = tuple(replace(u, reshard_after_forward=True) if u.is_root else u for u in c.units)
        out.append(ctx.check_units(units, c.choice, f"{c.status}, root resharded after forward",
                                   c.linear_peak_mib, method=c.method))
    return out


def no_wrapping(ctx: PlanContext, choice: GlobalChoice) -> list[Checked]:
    """The whole model as one unit, the root, with no inner units: the fewest collectives and no
    per-unit hooks, often the fastest on small models; kept gathered from forward to backward (FSDP2's
    default for the root) and resharded after forward. The program cannot express it (repeated blocks
    are always units, :mod:`.space`), so it is judged here by the simulators, beside the policies."""
    base_choice = replace(choice, prefetch=Prefetch())  # nothing to prefetch: one unit
    return [ctx.check_units((Unit((ROOT,), reshard_after_forward=r),), base_choice,
                            f"no wrapping (the whole model one unit, root reshard {r})", method="no-wrapping")
            for r in (False, True)]


def baseline_points(ctx: PlanContext, evaluated: list[Checked], answer: Checked) -> list[FrontierPoint]:
    """The recipes among ``evaluated``, as the plan file's ``baselines``: per recipe, at the answer's
    micro-batch (so that step times compare), its fastest plan that fits, else its smallest; their
    allocator retries priced, as the answer's (solve/survive.py [Note: Ranked by the priced time])."""
    best: dict[str, tuple[Checked, float]] = {}
    for c in evaluated:
        if c.method != RECIPE_METHOD or c.choice.micro_batch != answer.choice.micro_batch:
            continue
        key = (ctx.shown_fits(c), -priced_step_time_s(ctx, c) if ctx.shown_fits(c) else -c.peak_bytes)
        if c.status not in best or key > best[c.status][1]:
            best[c.status] = (c, key)
    return [FrontierPoint(peak_bytes=c.peak_bytes, step_time_s=priced_step_time_s(ctx, c), description=c.status,
                          fits=key[0]) for c, key in best.values()]
