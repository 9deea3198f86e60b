"""``plan_model(trace, request) -> PlanResult``: the fastest plan that fits (or, within
``request.simpler_within`` of it, a simpler one), the frontier, the baselines — a thin orchestrator.

1. Global choices (outer loops): mesh (plain FSDP over every GPU, or HSDP with the node as the shard
   group when the cluster spans nodes), micro-batch (given, or every power of two with
   ``search_batch``), prefetch depths (solve/choice.py ``PREFETCH_CHOICES``), and CPU offload only when nothing fits
   without it. Mesh x prefetch are screened by the simulated speed of a heuristic cover; the best
   ``SCREEN_KEEP`` get a CP-SAT solve (:func:`_screen`), each next one hinted with the earlier covers.
2. For each: the linear model (:mod:`.linear`, built once per choice), the CP-SAT program
   (:mod:`.cpsat`) with a greedy hint, then the simulator check (:func:`_solve_checked`) of the
   solution and of CP-SAT's last incumbents: the simulators' peak must fit the budget; when it does
   not, the budget given to the program is tightened by the observed gap and the rejected cover is
   cut off, a bounded number of times. The simulator wins. The solved cover is also simulated at the
   other prefetch depths (:func:`_other_prefetch`). Every simulator call goes through
   :meth:`.context.PlanContext.estimate` (memoised, no timeline; see [Note: one call to the cost model]).
3. The best checked plan by simulated throughput, against what the program cannot express, judged
   by the same simulators: the solver's plans with the root resharded after forward
   (:mod:`.alternatives`), no wrapping at all, and every recipe (:mod:`shard_planner.plan.recipes`) at every global
   choice the search found;
   the frontier by a budget sweep at its global choice (:mod:`.frontier`). The solver line names
   what won.
4. The chosen plan is polished by a simulator-guided local search (:mod:`.polish`: drop, merge or
   split units, toggle one unit's reshard or checkpointing, prefetch +-1) for at most
   ``POLISH_MODULE_EVALUATIONS`` module-simulations (:func:`_polished`); the solver line says when it
   helped. The frontier and the baselines are those of step 3. Then the simplest plan within
   ``request.simpler_within`` of the fastest (:mod:`.simpler`: fewest distinct unit shapes) is the
   answer, unless a recipe that fits is faster (:mod:`.never_worse`: then the fastest plan found, or
   the recipe).
5. Nothing found: the smallest-peak plans (CP-SAT's minimum linear peak, and the recipes, per mesh and
   offload) are judged by the simulators; one that fits is returned (the budget
   solves can miss it: time limits, re-solves exhausted by the linear model's error). Otherwise
   :class:`~shard_planner.errors.InfeasibleError` with the smallest budget any of them needs (always
   larger than the asked one), that plan, and what dominates memory there.

The budget every step fills is ``profile.tensor_budget_bytes(mem_budget_bytes)``: ``--mem`` (at most
the device's memory) times the profile's ``usable_fraction``, compared with the simulators' allocated peak
(the profile's overhead included). On a CPU profile that is the rule (the rest of --mem: the OS, the ranks'
process images). On a GPU profile it is only the search's filter: what fits is decided by the caching
allocator's simulation of the answer's first two steps on --mem (cost/fits.py), and the answer is solved
again at a tighter allocated budget when it does not survive (:mod:`.survive`, around the search here,
:func:`_plan_at_budget`). Messages give budgets in ``--mem`` terms (``profile.mem_for_tensor_budget``).
"""


from __future__ import annotations

import logging
import math
from dataclasses import replace

from shard_planner.cost.host_share import host_factors, ranks_per_host
from shard_planner.plan import Prefetch, SolverInfo
from shard_planner.errors import InfeasibleError, UserError
from shard_planner.plan.engine import FSDP2, SINGLE
from shard_planner.solve import alternatives, cpsat, simpler
from shard_planner.solve.accumulation import (
    NO_ACCUMULATION, Accumulation, accumulation_options, resolve_global_batch, split_global_batch,
)
from shard_planner.solve.context import Checked, PlanContext, planned_engine, speed
from shard_planner.solve.describe import budget_text, infeasible_error
from shard_planner.solve.frontier import pareto, start_sweep, sweep
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.linear import MIB, evaluate
from shard_planner.solve.never_worse import never_worse
from shard_planner.solve.polish import polish
from shard_planner.solve.request import PlanRequest, PlanResult
from shard_planner.solve.survive import plan_surviving, priced_step_time_s, surviving_choice
from shard_planner.trace.types import ModelTrace
from shard_planner.units import format_bytes

logger = logging.getLogger(__name__)

MAX_RECHECKS = 4  # re-solves when the simulator rejects the program's cover
# Global choices (mesh x prefetch) solved with CP-SAT after screening. One: the others' covers are
# judged at every prefetch depth anyway (_other_prefetch); on bench_plan's 12 cases a second solved
# choice found no faster plan and cost 0.5-1.2 s of CPU (Llama 8B/70B).
SCREEN_KEEP = 1
MAX_SEARCH_BATCH = 1024
# The simulators accept the program's cover with more than this share of the budget to spare: the
# linear model over-estimated, so the program is solved once more with its budget loosened by the slack.
LOOSEN_MIN_SLACK = 0.02
# The chosen plan is polished by a local search (.polish) that judges at most
# POLISH_MODULE_EVALUATIONS / (modules in the trace) plans: a simulation costs about in proportion to
# the modules, so this bounds the work, and unlike a time budget it gives the same answer on a busy
# machine (Llama 8B: 154 plans, 389 modules; 70B: 62; encdec base: 314, which its best plan needs).
# POLISH_MAX_S of wall clock stops it whatever the count (a guard for a very busy machine).
POLISH_MODULE_EVALUATIONS = 60_000
POLISH_MAX_S = 3.0


def plan_model(trace: ModelTrace, request: PlanRequest) -> PlanResult:
    """The fastest plan for ``trace`` on ``request.gpus`` GPUs that fits ``request.mem_budget_bytes`` per GPU
    (its simulated peak within ``profile.tensor_budget_bytes``; on a GPU profile its simulated allocator
    surviving --mem too: :mod:`.survive`), or the simplest within ``request.simpler_within`` of it, with the
    frontier, the recipes as baselines, the chosen plan's estimate and where the time went. Pure: no
    files, no printing. At one GPU the single-device step when the planner picked it (solve/context.py
    ``planned_engine``) and some plan of it fits, else FSDP2, whose CPU offload may fit what one device
    cannot hold (a warning says so)."""
    try:
        return plan_surviving(trace, request, _plan_at_budget)
    except InfeasibleError:
        if request.engine is not None or request.optimizer_in_backward or planned_engine(trace, request) != SINGLE:
            raise
        logger.warning("one GPU: no single-device plan fits %s; planning FSDP2 on one GPU, whose CPU offload may "
                       "fit (--engine single insists)", format_bytes(request.mem_budget_bytes))
        return plan_surviving(trace, replace(request, engine=FSDP2), _plan_at_budget)


def _plan_at_budget(trace: ModelTrace, request: PlanRequest) -> PlanResult:
    """The search at the allocated budget of ``request`` (the module docstring's steps 1-5)."""
    ctx = PlanContext(trace, request)
    try:
        return _plan(ctx)
    finally:
        ctx.close()


def _plan(ctx: PlanContext) -> PlanResult:
    request = ctx.request
    profile = request.profile
    if request.mem_budget_bytes > profile.memory_bytes and not profile.is_nominal_size(request.mem_budget_bytes):
        logger.warning("budget %s exceeds the memory of a %s device (%s): planning for %s",
                       format_bytes(request.mem_budget_bytes), profile.name, format_bytes(profile.memory_bytes),
                       budget_text(profile, request.mem_budget_bytes))
    share = host_factors(profile, request.run_ranks or request.gpus)[0]
    if share > 1:
        ranks = ranks_per_host(profile, request.run_ranks or request.gpus)
        logger.warning("%d ranks share this host's %d cores: each runs at 1/%.3g of a core, which the step time "
                       "includes; the ranks' waits for a core at every collective are not modelled "
                       "(`shard-planner calibrate --world-size %d` measures them into a profile)",
                       ranks, profile.host_cores, share, ranks)
    found = _search(ctx)
    best = max(found, key=speed)
    with ctx.clock.stage("frontier"):
        swept = sweep(ctx, best, request.frontier_points)
    with ctx.clock.stage("baselines"):  # every recipe at every global choice found (never_worse.py)
        recipes = alternatives.recipes(ctx, dict.fromkeys(c.choice for c in (best, *found)))
        others = (alternatives.root_resharded(ctx, found) + alternatives.no_wrapping(ctx, best.choice) + recipes
                  + alternatives.start_plans(ctx))
    evaluated = swept + others
    pool = found + [c for c in evaluated if c.peak_bytes <= ctx.budget_bytes]
    chosen = max(pool, key=speed)  # the simulators' numbers decide
    status = (chosen.status if chosen is best or chosen.method == "cp-sat"
              else f"{best.status}; by the simulators {chosen.status} is " + (
                  "faster" if chosen.step_time_s < best.step_time_s * (1 - 1e-9) else "as fast and needs less memory"))
    with ctx.clock.stage("polish"):
        chosen, status = _polished(ctx, chosen, status)
    with ctx.clock.stage("simplify"):
        chosen, status, fastest = simpler.prefer_simpler(ctx, chosen, pool, status)
    chosen, status = surviving_choice(ctx, chosen, pool, status)  # on a GPU (solve/survive.py)
    chosen, status = never_worse(ctx, chosen, fastest, recipes, status)
    est = ctx.estimate(chosen.plan, timeline=True)  # the report's memory timeline
    fit = ctx.device_fit(chosen.plan)  # on a GPU: the caching allocator over two steps (cost/fits.py)
    plan = replace(
        chosen.plan,
        predicted=fit.priced(est.prediction()) if fit else est.prediction(),  # retries priced in (cost/retries.py)
        solver=SolverInfo(method=chosen.method, status=status, objective=chosen.step_time_s,
                          seconds=ctx.clock.elapsed_s()),
        frontier=tuple(pareto(ctx, found + evaluated)),
        baselines=tuple(alternatives.baseline_points(ctx, evaluated, chosen)),
    )
    return PlanResult(plan=plan, estimate=est, timings=ctx.clock.timings(ctx.simulated_plans),
                      fastest_step_time_s=fastest.step_time_s, fit=fit)


def screen_degree(trace: ModelTrace, request: PlanRequest) -> Checked | None:
    """The fastest plan of a cheap look at ``trace``'s degree, for screening tensor-parallel degrees
    (solve/layout_search.py [Note: Screening the layouts]): at every micro-batch the global batch allows (or
    the request's), plain FSDP over the data-parallel ranks, FSDP2's default prefetch and the leanest
    accumulation policy, the heuristic cover (:func:`cpsat.greedy_cover`), every uniform cover
    (:func:`cpsat.uniform_covers`: the full search often ends on one) and the recipes judged by
    the simulators at the allocated budget; on a GPU the fastest of them that survives --mem in the allocator,
    ranked and shown with its retries priced (survive.py [Note: Ranked by the priced time]). None when none
    of them fits or survives. Raises what
    :func:`plan_model` raises for a request the degree cannot meet (a global batch its data-parallel ranks
    do not divide)."""
    ctx = PlanContext(trace, request)
    try:
        fitting: list[Checked] = []
        mesh = ctx.layouts[0]
        for mb, accumulations in _batches(ctx):
            choice = GlobalChoice(mb, ctx.prefetch_choices[0], mesh, False, accumulations[0], ctx.engine)
            lm = ctx.linear(choice)
            cover = ctx.greedy(lm, ctx.budget_mib)
            judged = ([ctx.check(lm, cover, "heuristic")] if cover is not None else []) + alternatives.recipes(
                ctx, [choice])
            for uniform in sorted(cpsat.uniform_covers(lm).values(), key=lambda c: evaluate(lm, c).time_us):
                judged.append(ctx.check(lm, uniform, "heuristic"))
                if judged[-1].peak_bytes <= ctx.budget_bytes:
                    break  # the slower uniform covers, by the linear model's time, are not judged
            fitting += [c for c in judged if c.peak_bytes <= ctx.budget_bytes]
        if not fitting:
            return None
        best, _ = surviving_choice(ctx, max(fitting, key=speed), fitting, "screened")
        fit = ctx.device_fit(best.plan)
        if fit is not None and not fit.survives:
            return None  # none of the fastest survives the allocator: as if none fitted
        priced_s = priced_step_time_s(ctx, best)
        if priced_s == best.step_time_s:
            return best
        return replace(best, step_time_s=priced_s, samples_per_s=best.samples_per_s * best.step_time_s / priced_s)
    finally:
        ctx.close()


def _search(ctx: PlanContext) -> list[Checked]:
    """Every checked plan that fits, over the global choices (offload only when nothing fits without
    it; micro-batches up the ladder while one fits); the smallest-peak plans when none does, or
    :class:`InfeasibleError`."""
    request = ctx.request
    batches = _batches(ctx)
    ladder = request.search_batch or len(batches) > 1
    found: list[Checked] = []
    for offload in (False, True) if ctx.allow_offload else (False,):
        for mb, accumulations in batches:
            choices = [GlobalChoice(mb, pf, mesh, offload, acc, ctx.engine) for acc in accumulations
                       for mesh in ctx.layouts
                       for pf in ctx.prefetch_choices]
            with ctx.clock.stage("screen"):
                kept = _screen(ctx, choices)
            if kept and not found:
                start_sweep(ctx, kept[0])
            at_batch = []
            for choice in kept:
                with ctx.clock.stage("solve"):
                    checked = _solve_checked(ctx, choice, hints=tuple(c.cover for c in found
                                                                       if c.choice.mesh == choice.mesh))
                    if checked is not None:
                        at_batch += [checked, *_other_prefetch(ctx, checked),
                                     *_other_accumulation(ctx, checked, accumulations)]
            found += at_batch
            if ladder and not at_batch:
                break  # a larger micro-batch only needs more memory
        if found:
            if offload:
                logger.warning("no plan fits without CPU offload; offloading sharded state to the host")
            return found
    # The budget solves above work on the linear model, which can over-estimate the simulators'
    # peak; the smallest-peak plans are judged by the simulators, and one that fits is a plan.
    mb, accumulations = batches[0]
    with ctx.clock.stage("solve"):
        smallest = _smallest_peak(ctx, mb, accumulations[0])
    fitting = [c for c in smallest if c.peak_bytes <= ctx.budget_bytes]
    if not fitting:
        raise infeasible_error(ctx, mb, smallest)
    return fitting


def _batches(ctx: PlanContext) -> list[tuple[int, list[Accumulation]]]:
    """The micro-batches to try, smallest first, each with the accumulation policies to try at it:
    the given one (or 1); the ladder with ``search_batch``; with a global batch every micro-batch that
    reaches it (solve/accumulation.py), leanest policy first."""
    request = ctx.request
    batch = resolve_global_batch(request.global_batch_samples, request.global_batch_tokens,
                                 ctx.trace.tokens_per_sample, ctx.trace.model_path)
    if batch is None:
        mbs = [request.micro_batch or 1] if not request.search_batch else _batch_ladder()
        return [(mb, [NO_ACCUMULATION]) for mb in mbs]
    # a tp group shares one micro-batch: every layout searched has the same data-parallel ranks
    pairs = split_global_batch(batch, ctx.layouts[0].dp_size, request.micro_batch, ctx.trace.tokens_per_sample)
    # the policies between micro-steps are FSDP2's: one device adds every micro-step's gradients into .grad;
    # with the optimizer in backward there are no micro-steps to add (cost/engines/single.py)
    if request.optimizer_in_backward:
        pairs = [(mb, steps) for mb, steps in pairs if steps == 1]
        if not pairs:
            raise UserError(f"--optimizer-in-backward steps every micro-batch: the global batch {batch.samples} "
                            f"needs accumulation at any micro-batch that fits here; give --batch-size "
                            f"{batch.samples} or drop one of the two")
    return [(mb, accumulation_options(steps)[:1 if ctx.engine == SINGLE else None]) for mb, steps in pairs]


def _other_accumulation(ctx: PlanContext, checked: Checked, accumulations: list[Accumulation]) -> list[Checked]:
    """The solved cover under the other accumulation policies at its micro-batch, judged by the simulators
    (as :func:`_other_prefetch`: the policies move memory and communication, not which units are best).
    Only those that fit the budget."""
    out = []
    for acc in accumulations:
        if acc == checked.choice.accumulation:
            continue
        choice = replace(checked.choice, accumulation=acc)
        c = ctx.check(ctx.linear(choice), checked.cover, f"{checked.status} (units solved with "
                      f"{checked.choice.accumulation.label})")
        if c.peak_bytes <= ctx.budget_bytes:
            out.append(c)
    return out


def _polished(ctx: PlanContext, chosen: Checked, status: str) -> tuple[Checked, str]:
    """The chosen plan after the simulator-guided local search (:mod:`.polish`), at most
    ``POLISH_MODULE_EVALUATIONS`` module-simulations and ``POLISH_MAX_S``; the status says when it
    improved. The search judges plans through the planner's memo (:meth:`PlanContext.estimate`)."""
    choices = ctx.prefetch_choices
    lo = Prefetch(min(p.forward for p in choices), min(p.backward for p in choices))
    hi = Prefetch(max(p.forward for p in choices), max(p.backward for p in choices))
    plan, info = polish(ctx.trace, chosen.plan, ctx.profile, ctx.budget_bytes, time_budget_s=POLISH_MAX_S,
                        max_group_size=ctx.max_group_size, prefetch_bounds=(lo, hi), estimate=ctx.estimate,
                        max_evaluations=max(1, POLISH_MODULE_EVALUATIONS // max(1, len(ctx.trace.modules))))
    if not info.moves:
        return chosen, status
    c = ctx.check_units(plan.units, replace(chosen.choice, prefetch=plan.prefetch), chosen.status,
                        chosen.linear_peak_mib, method=chosen.method)
    if c.peak_bytes > ctx.budget_bytes or c.step_time_s >= chosen.step_time_s:
        return chosen, status  # the full simulators disagree with the search's (they should not)
    n = len(info.moves)
    return c, (f"{status}; polished by local search: {100 * (c.step_time_s / chosen.step_time_s - 1):+.1f}% "
               f"step time in {n} move{'s' if n > 1 else ''}")


def _batch_ladder() -> list[int]:
    return [2**k for k in range(int(math.log2(MAX_SEARCH_BATCH)) + 1)]


def _screen(ctx: PlanContext, choices: list[GlobalChoice]) -> list[GlobalChoice]:
    """The global choices worth a CP-SAT solve: rank them by the simulated speed of their heuristic
    cover (:func:`cpsat.greedy_cover`, milliseconds each) and keep the best ``SCREEN_KEEP``; choices
    whose heuristic cover does not fit the simulators come after, in case CP-SAT finds one that does."""
    ranked = []
    for order, choice in enumerate(choices):
        lm = ctx.linear(choice)
        cover = ctx.greedy(lm, ctx.budget_mib)
        c = ctx.check(lm, cover, "heuristic") if cover is not None else None
        fits = c is not None and c.peak_bytes <= ctx.budget_bytes
        ranked.append((0 if fits else 1, -c.samples_per_s if fits else 0.0, order, choice))
    ranked.sort(key=lambda r: r[:3])
    fitting = [r[3] for r in ranked if r[0] == 0]
    return fitting[:SCREEN_KEEP] if fitting else [r[3] for r in ranked]


def _other_prefetch(ctx: PlanContext, checked: Checked) -> list[Checked]:
    """The solved cover at the other prefetch depths, judged by the simulators (milliseconds each,
    where a CP-SAT solve per depth takes a second): prefetch mostly moves memory and exposed
    communication, not which units are best. Only those that fit the budget."""
    out = []
    for pf in ctx.prefetch_choices:
        if pf == checked.choice.prefetch:
            continue
        choice = replace(checked.choice, prefetch=pf)
        c = ctx.check(ctx.linear(choice), checked.cover,
                      f"{checked.status} (units solved at prefetch fwd {checked.choice.prefetch.forward}"
                      f"/bwd {checked.choice.prefetch.backward})")
        if c.peak_bytes <= ctx.budget_bytes:
            out.append(c)
    return out


def _solve_checked(ctx: PlanContext, choice: GlobalChoice, hints: tuple = ()) -> Checked | None:
    """CP-SAT at the budget, then the simulators, which have the last word (bounded iterations).
    The simulators judge the solution and CP-SAT's last incumbents before it (near-optimal by the
    linear model, which cannot rank them finely: :data:`cpsat.INCUMBENTS_KEPT`); the fastest that fits
    is kept. Then:

    - the simulators reject the cover (peak over budget): cut it off and tighten the program's budget
      by the gap they observed;
    - they accept it with room to spare, or the program finds no cover at all: the linear model
      over-estimated; loosen the program's budget by the observed slack once (for no cover: by the
      over-estimate on the leanest cover, which must itself fit) and keep the faster accepted plan. When
      the simulators reject the loosened cover and the linear model did not under-estimate it, the loop
      ends: tightening by the gap would re-solve at the budget, the solve already done (Llama 70B on 64
      GPUs: one CP-SAT solve, ~1 s, fewer; the same plan).

    Each solve at the budget is kept even when another global choice already measured the linear
    model's over-estimate: starting the second choice loosened by it saved 1 s on Llama 8B but found
    plans 0.4% (Llama 8B, 40GB) and 10% (ViT-L, 5GB) slower, since these time-limited solves land on
    different covers and the simulators rank them differently from the linear model.
    """
    budget_mib, budget_bytes = ctx.budget_mib, ctx.budget_bytes
    lm = ctx.linear(choice)
    effective = budget_mib
    forbidden: list[tuple[int, ...]] = []
    best: Checked | None = None
    loosened = False
    for attempt in range(MAX_RECHECKS + 1):
        res = ctx.min_time(lm, effective, time_limit_s=ctx.time_limit_s, hint=ctx.greedy(lm, effective),
                           forbidden=forbidden, extra_hints=hints + ((best.cover,) if best else ()))
        if res.chosen is None:
            if loosened or best is not None:
                break
            low = ctx.min_peak(lm, ctx.time_limit_s)
            if low.chosen is None:
                break
            lean = ctx.check(lm, low.chosen, low.status)
            if lean.peak_bytes > budget_bytes:
                break  # not even the leanest cover fits
            best, loosened = lean, True
            effective = budget_mib + max(0, low.objective - math.ceil(lean.peak_bytes / MIB))
            continue
        checked = ctx.check(lm, res.chosen, res.status)
        runners_up = [ctx.check(lm, cover, f"{res.status}; an earlier incumbent, faster by the simulators")
                      for cover in res.runners_up if cover not in forbidden]
        for c in (checked, *runners_up):
            if c.peak_bytes <= budget_bytes and (best is None or speed(c) > speed(best)):
                best = c
        sim_mib = math.ceil(checked.peak_bytes / MIB)
        if checked.peak_bytes <= budget_bytes:
            slack = budget_mib - sim_mib
            if loosened or slack <= max(1, int(budget_mib * LOOSEN_MIN_SLACK)):  # not worth a re-solve
                break
            loosened = True
            effective = effective + slack
            continue
        tightened = min(effective - 1, budget_mib - max(sim_mib - checked.linear_peak_mib, 0) - 1)
        if loosened and tightened >= budget_mib - 1:
            # the loosened cover does not fit, and the linear model did not under-estimate it: the re-solve
            # would be the solve at the budget already done (its answer is ``best``, or it found none)
            logger.debug("%s: the loosened cover does not fit the simulators (%d MiB > %d MiB); keeping the "
                         "solve at the budget", choice.label, sim_mib, budget_mib)
            break
        logger.debug("%s: simulator peak %d MiB > budget %d MiB (linear said %d): re-solving", choice.label,
                     sim_mib, budget_mib, checked.linear_peak_mib)
        forbidden.append(res.chosen)
        effective = tightened
        if effective <= 0:
            break
    for label, cover in cpsat.uniform_covers(lm).items():  # judged by the simulators alone (cpsat.uniform_covers)
        c = ctx.check(lm, cover, f"every block {label}, judged by the simulators")
        if c.peak_bytes <= budget_bytes and (best is None or speed(c) > speed(best)):
            best = c
    return best




def _smallest_peak(ctx: PlanContext, micro_batch: int, accumulation: Accumulation = NO_ACCUMULATION) -> list[Checked]:
    """Per mesh and offload setting, the plan of least linear-model peak, judged by the simulators;
    with the recipes at the same choices (the linear model is an approximation, so
    another plan may have the smallest simulated peak)."""
    out: list[Checked] = []
    for mesh in ctx.layouts:
        for offload in ((False, True) if ctx.allow_offload else (False,)):
            for pf in ctx.prefetch_choices[:1]:  # deeper prefetch only adds memory
                choice = GlobalChoice(micro_batch, pf, mesh, offload, accumulation, ctx.engine)
                lm = ctx.linear(choice)
                res = ctx.min_peak(lm, ctx.time_limit_s)
                if res.chosen is not None:
                    out.append(ctx.check(lm, res.chosen, res.status))
                out.extend(alternatives.recipes(ctx, [choice]))
    return out
