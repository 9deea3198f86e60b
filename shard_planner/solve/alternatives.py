"""What the program cannot express, judged by the same simulators as its plans: the hand-written
policies (:mod:`.baselines`), the whole model as one unit, and the solver's plans with the root
resharded after forward."""

from __future__ import annotations

from dataclasses import replace

from shard_planner.plan import ROOT, FrontierPoint, Prefetch, Unit
from shard_planner.solve.baselines import hand_written_units
from shard_planner.solve.context import Checked, PlanContext
from shard_planner.solve.linear import GlobalChoice
from shard_planner.solve.survive import priced_step_time_s


def hand_written(ctx: PlanContext, choice: GlobalChoice) -> list[Checked]:
    """The hand-written policies at the chosen micro-batch and mesh, FSDP2's default prefetch."""
    space = ctx.space(choice.mesh)
    base_choice = replace(choice, prefetch=Prefetch())
    return [ctx.check_units(units, base_choice, name, method="hand-written")
            for name, units in hand_written_units(space, ctx.trace)]


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


def baseline_points(ctx: PlanContext, evaluated: list[Checked]) -> list[FrontierPoint]:
    """The hand-written policies among ``evaluated``, as the plan file's ``baselines`` (their allocator
    retries priced, as the answer's: solve/survive.py [Note: Ranked by the priced time])."""
    return [FrontierPoint(peak_bytes=c.peak_bytes, step_time_s=priced_step_time_s(ctx, c), description=c.status,
                          fits=ctx.shown_fits(c))
            for c in evaluated if c.method == "hand-written"]
