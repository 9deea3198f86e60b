"""``plan_model``: the fastest plan that fits, the frontier, the baselines — a thin orchestrator.

1. Global choices (outer loops): mesh (plain FSDP over every GPU, or HSDP with the node as the shard
   group when the cluster spans nodes), micro-batch (given, or every power of two with
   ``search_batch``), prefetch depths (``PREFETCH_CHOICES``), and CPU offload only when nothing fits
   without it. Mesh x prefetch are screened by the simulated speed of a heuristic cover; the best
   ``SCREEN_KEEP`` get a CP-SAT solve (:func:`_screen`), the next one hinted with the first's cover.
2. For each: the linear model (:mod:`.linear`, built once per choice), the CP-SAT program
   (:mod:`.cpsat`) with a greedy hint, then the simulator check (:func:`_solve_checked`) of the
   solution and of CP-SAT's last incumbents: the simulators' peak must fit the budget; when it does
   not, the budget given to the program is tightened by the observed gap and the rejected cover is
   cut off, a bounded number of times. The simulator wins. The solved cover is also simulated at the
   other prefetch depths (:func:`_other_prefetch`).
3. The best checked plan by simulated throughput, against what the program cannot express, judged
   by the same simulators: the solver's plans with the root resharded after forward
   (:func:`_root_resharded`), no wrapping at all (:func:`_no_wrapping`), and the hand-written
   policies (:mod:`.baselines`); the frontier by a budget sweep at its global choice. The solver
   line names what won.
4. The chosen plan is polished by a simulator-guided local search (:mod:`.polish`: drop, merge or
   split units, toggle one unit's reshard or checkpointing, prefetch +-1) for a quarter of the time
   spent so far, at most 0.75 s (:func:`_polished`); the solver line says when it helped. The
   frontier and the baselines are those of step 3.
5. Nothing found: the smallest-peak plans (CP-SAT's minimum linear peak, and the hand-written
   policies, per mesh and offload) are judged by the simulators; one that fits is returned (the budget
   solves can miss it: time limits, re-solves exhausted by the linear model's error). Otherwise
   :class:`InfeasibleError` with the smallest budget any of them needs (always larger than the asked
   one), that plan, and what dominates memory there.

The budget every step fills is ``profile.tensor_budget_bytes(mem_budget_bytes)``: ``--mem`` (at most
the device's memory) less the profile's share kept for caching-allocator fragmentation (1 -
``usable_fraction``; REFERENCE.md). The predicted peak counts allocated bytes, and the allocator
reserves more than it allocates, so a plan that filled all of ``--mem`` would not run. Messages give
both numbers, and budgets in ``--mem`` terms (``profile.mem_for_tensor_budget``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

from shard_planner.errors import InfeasibleError, UserError
from shard_planner.plan import (
    ROOT, Cluster, FrontierPoint, Mesh, Plan, Prefetch, SolverInfo, Training, Unit,
)
from shard_planner.profile import HardwareProfile
from shard_planner.solve import cpsat
from shard_planner.solve.baselines import POLICIES
from shard_planner.solve.linear import MIB, GlobalChoice, LinearModel, build_linear_model, evaluate
from shard_planner.solve.polish import polish
from shard_planner.solve.simulate import cover_units, make_plan, simulate
from shard_planner.solve.space import DEFAULT_MAX_GROUP_SIZE, SearchSpace, build_space
from shard_planner.trace.types import ModelTrace
from shard_planner.units import format_bytes

logger = logging.getLogger(__name__)

# (forward, backward) prefetch depths tried: FSDP2's default, one explicit unit ahead, two both ways.
PREFETCH_CHOICES = (Prefetch(0, 1), Prefetch(1, 1), Prefetch(2, 2))
MAX_RECHECKS = 4  # re-solves when the simulator rejects the program's cover
SCREEN_KEEP = 2  # global choices (mesh x prefetch) solved with CP-SAT after screening
# The frontier's smallest-peak and inner budget points are for the plot first (the answer is solved at
# the budget): each gets this share of the per-solve time limit.
FRONTIER_TIME_SHARE = 0.25
MAX_SEARCH_BATCH = 1024
DEFAULT_FRONTIER_POINTS = 4
# The chosen plan is polished by a local search (.polish) for this share of the time spent before it,
# at most POLISH_MAX_S: the search is anytime, and with the full simulators' re-check of its answer it
# adds at most about a second to a 5-10 s plan (Llama 70B on 64 GPUs: 0.76 s, the search cut short).
POLISH_SHARE = 0.25
POLISH_MAX_S = 0.75


@dataclass(frozen=True)
class Checked:
    """A cover the simulators accepted (or the best they saw), with its numbers."""

    choice: GlobalChoice
    units: tuple[Unit, ...]
    peak_bytes: int
    step_time_s: float
    samples_per_s: float
    status: str  # the solver's status, or the policy's name for a hand-written plan
    linear_peak_mib: int
    plan: Plan
    estimate: object  # cost.types.Estimate
    method: str = "cp-sat"
    cover: tuple[int, ...] | None = None  # candidate indices (None for hand-written plans)


def plan_model(trace: ModelTrace, *, gpus: int, mem_budget_bytes: int, profile: HardwareProfile,
               gpus_per_node: int = 8, micro_batch: int | None = None, search_batch: bool = False,
               optimizer: str = "adamw", param_dtype: str = "bfloat16", reduce_dtype: str = "float32",
               time_limit_s: float = cpsat.DEFAULT_TIME_LIMIT_S, max_group_size: int = DEFAULT_MAX_GROUP_SIZE,
               frontier_points: int = DEFAULT_FRONTIER_POINTS, allow_offload: bool = True,
               model_path: str | None = None, profile_name: str | None = None,
               timings_path: str | None = None) -> Plan:
    """The fastest plan for ``trace`` on ``gpus`` GPUs whose simulated peak fits
    ``profile.tensor_budget_bytes(mem_budget_bytes)`` per GPU (``--mem`` less the fragmentation share),
    with the frontier and the hand-written baselines. Pure: no files, no printing. ``profile_name`` and
    ``timings_path`` are what the plan records of how it was priced (``cluster.profile``, ``cluster.timings``:
    the file ``profile.module_timings`` came from)."""
    t0 = time.perf_counter()
    if gpus < 1 or gpus_per_node < 1:
        raise UserError(f"--gpus and --gpus-per-node must be positive, got {gpus} and {gpus_per_node}")
    if micro_batch is not None and micro_batch < 1:
        raise UserError(f"--batch-size must be a positive int, got {micro_batch}")
    budget = profile.tensor_budget_bytes(mem_budget_bytes)
    if mem_budget_bytes > profile.memory_bytes:
        logger.warning("budget %s exceeds the memory of a %s device (%s): planning for %s", format_bytes(mem_budget_bytes),
                       profile.name, format_bytes(profile.memory_bytes), _budget_text(profile, mem_budget_bytes))
    training = Training(micro_batch=micro_batch or 1, optimizer=optimizer, param_dtype=param_dtype,
                        reduce_dtype=reduce_dtype)
    cluster = Cluster(gpus=gpus, gpus_per_node=min(gpus_per_node, gpus), profile=profile_name or profile.name,
                      mem_budget_bytes=mem_budget_bytes, timings=timings_path)
    ctx = _Context(trace, profile, training, cluster, budget, time_limit_s, max_group_size, model_path)
    ctx.allow_offload = allow_offload and profile.device != "cpu"

    batches = [micro_batch or 1] if not search_batch else _batch_ladder()
    offloads = (False, True) if ctx.allow_offload else (False,)
    found: list[Checked] = []
    for offload in offloads:
        for mb in batches:
            best_at_batch = None
            choices = [GlobalChoice(mb, pf, mesh, offload)
                       for mesh in _meshes(gpus, cluster.gpus_per_node) for pf in PREFETCH_CHOICES]
            for choice in _screen(ctx, choices):
                checked = _solve_checked(ctx, ctx.space(choice.mesh), choice,
                                         hints=tuple(c.cover for c in found if c.choice.mesh == choice.mesh))
                if checked is None:
                    continue
                for c in (checked, *_other_prefetch(ctx, checked)):
                    found.append(c)
                    if best_at_batch is None or c.samples_per_s > best_at_batch.samples_per_s:
                        best_at_batch = c
            if search_batch and best_at_batch is None:
                break  # a larger micro-batch only needs more memory
        if found:
            if offload:
                logger.warning("no plan fits without CPU offload; offloading sharded state to the host")
            break
    if not found:
        # The budget solves above work on the linear model, which can over-estimate the simulators'
        # peak; the smallest-peak plans are judged by the simulators, and one that fits is a plan.
        smallest = _smallest_peak(ctx, batches[0])
        fitting = [c for c in smallest if c.peak_bytes <= ctx.budget_bytes]
        if not fitting:
            raise _infeasible(ctx, batches[0], smallest)
        found = fitting

    best = max(found, key=_speed)
    evaluated = (_sweep(ctx, best, frontier_points) + _root_resharded(ctx, found) + _no_wrapping(ctx, best.choice)
                 + _hand_written(ctx, best.choice))
    pool = found + [c for c in evaluated if c.peak_bytes <= ctx.budget_bytes]
    chosen = max(pool, key=_speed)  # the simulators' numbers decide
    frontier = _pareto(ctx, found + evaluated)
    baselines = [FrontierPoint(peak_bytes=c.peak_bytes, step_time_s=c.step_time_s, description=c.status,
                               fits=c.peak_bytes <= ctx.budget_bytes)
                 for c in evaluated if c.method == "hand-written"]
    status = (chosen.status if chosen is best or chosen.method == "cp-sat"
              else f"{best.status}; by the simulators {chosen.status} is " + (
                  "faster" if chosen.step_time_s < best.step_time_s * (1 - 1e-9) else "as fast and needs less memory"))
    chosen, status = _polished(ctx, chosen, status, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    return replace(
        chosen.plan,
        predicted=chosen.estimate.prediction(),
        solver=SolverInfo(method=chosen.method, status=status, objective=chosen.step_time_s, seconds=seconds),
        frontier=tuple(frontier),
        baselines=tuple(baselines),
    )


def _polished(ctx: _Context, chosen: Checked, status: str, elapsed_s: float) -> tuple[Checked, str]:
    """The chosen plan after the simulator-guided local search (:mod:`.polish`), given
    ``POLISH_SHARE`` of the time spent so far (at most ``POLISH_MAX_S``); the status says when it
    improved. The polished plan is judged again by the full simulators, like every candidate."""
    time_budget_s = min(POLISH_MAX_S, POLISH_SHARE * elapsed_s)
    lo = Prefetch(min(p.forward for p in PREFETCH_CHOICES), min(p.backward for p in PREFETCH_CHOICES))
    hi = Prefetch(max(p.forward for p in PREFETCH_CHOICES), max(p.backward for p in PREFETCH_CHOICES))
    plan, info = polish(ctx.trace, chosen.plan, ctx.profile, ctx.budget_bytes, time_budget_s=time_budget_s,
                        max_group_size=ctx.max_group_size, prefetch_bounds=(lo, hi))
    if not info.moves:
        return chosen, status
    c = ctx.check_units(plan.units, replace(chosen.choice, prefetch=plan.prefetch), chosen.status,
                        chosen.linear_peak_mib, method=chosen.method)
    if c.peak_bytes > ctx.budget_bytes or c.step_time_s >= chosen.step_time_s:
        return chosen, status  # the full simulators disagree with the search's (they should not)
    n = len(info.moves)
    return c, (f"{status}; polished by local search: {100 * (c.step_time_s / chosen.step_time_s - 1):+.1f}% "
               f"step time in {n} move{'s' if n > 1 else ''}")


def _speed(c: "Checked"):
    return (c.samples_per_s, -c.peak_bytes)


class _Context:
    """What every solve shares: the request, and caches of search spaces."""

    def __init__(self, trace, profile, training, cluster, budget, time_limit_s, max_group_size, model_path):
        self.trace, self.profile, self.training, self.cluster = trace, profile, training, cluster
        self.budget_bytes = budget  # profile.tensor_budget_bytes(cluster.mem_budget_bytes): what plans may fill
        self.budget_mib = budget // MIB
        self.time_limit_s = time_limit_s
        self.max_group_size = max_group_size
        self.model_path = model_path
        self._spaces: dict[int, SearchSpace] = {}
        self._linear: dict[GlobalChoice, LinearModel] = {}
        self.allow_offload = False

    def space(self, mesh: Mesh) -> SearchSpace:
        if mesh.shard not in self._spaces:
            self._spaces[mesh.shard] = build_space(self.trace, shard_group=mesh.shard,
                                                   gpus_per_node=self.cluster.gpus_per_node,
                                                   max_group_size=self.max_group_size)
            if not self._spaces[mesh.shard].items:
                raise UserError(f"{self.trace.model_path}: the model has no modules with parameters to shard")
        return self._spaces[mesh.shard]

    def linear(self, space: SearchSpace, choice: GlobalChoice) -> LinearModel:
        """The linear model of ``choice`` (built once: the screen, the solves and the sweep share it)."""
        assert space is self.space(choice.mesh)
        if choice not in self._linear:
            self._linear[choice] = build_linear_model(self.trace, space, choice, self.training, self.profile)
        return self._linear[choice]

    def check(self, lm: LinearModel, chosen: tuple[int, ...], status: str) -> Checked:
        units = cover_units(lm, chosen)
        return replace(self.check_units(units, lm.choice, status, evaluate(lm, chosen).peak_mib), cover=chosen)

    def check_units(self, units, choice: GlobalChoice, status: str, linear_peak_mib: int = -1,
                    method: str = "cp-sat") -> Checked:
        plan = make_plan(self.trace, units, choice, training=self.training, cluster=self.cluster,
                         model_path=self.model_path)
        est = simulate(self.trace, plan, self.profile)
        return Checked(choice=choice, units=units, peak_bytes=est.memory.peak_bytes,
                       step_time_s=est.time.step_time_s, samples_per_s=est.time.samples_per_s, status=status,
                       linear_peak_mib=linear_peak_mib, plan=plan, estimate=est, method=method)


def _batch_ladder() -> list[int]:
    return [2**k for k in range(int(math.log2(MAX_SEARCH_BATCH)) + 1)]


def _meshes(gpus: int, gpus_per_node: int) -> list[Mesh]:
    """Plain FSDP over every GPU; and HSDP with one node per shard group when there are several nodes."""
    meshes = [Mesh(shard=gpus)]
    if gpus > gpus_per_node and gpus % gpus_per_node == 0:
        meshes.append(Mesh(shard=gpus_per_node, replicate=gpus // gpus_per_node))
    return meshes


def _screen(ctx: _Context, choices: list[GlobalChoice]) -> list[GlobalChoice]:
    """The global choices worth a CP-SAT solve: rank them by the simulated speed of their heuristic
    cover (:func:`cpsat.greedy_cover`, milliseconds each) and keep the best ``SCREEN_KEEP``; choices
    whose heuristic cover does not fit the simulators come after, in case CP-SAT finds one that does."""
    ranked = []
    for order, choice in enumerate(choices):
        lm = ctx.linear(ctx.space(choice.mesh), choice)
        cover = cpsat.greedy_cover(lm, ctx.budget_mib)
        c = ctx.check(lm, cover, "heuristic") if cover is not None else None
        fits = c is not None and c.peak_bytes <= ctx.budget_bytes
        ranked.append((0 if fits else 1, -c.samples_per_s if fits else 0.0, order, choice))
    ranked.sort(key=lambda r: r[:3])
    fitting = [r[3] for r in ranked if r[0] == 0]
    return fitting[:SCREEN_KEEP] if fitting else [r[3] for r in ranked]


def _other_prefetch(ctx: _Context, checked: Checked) -> list[Checked]:
    """The solved cover at the other prefetch depths, judged by the simulators (milliseconds each,
    where a CP-SAT solve per depth takes a second): prefetch mostly moves memory and exposed
    communication, not which units are best. Only those that fit the budget."""
    out = []
    space = ctx.space(checked.choice.mesh)
    for pf in PREFETCH_CHOICES:
        if pf == checked.choice.prefetch:
            continue
        choice = replace(checked.choice, prefetch=pf)
        c = ctx.check(ctx.linear(space, choice), checked.cover,
                      f"{checked.status} (units solved at prefetch fwd {checked.choice.prefetch.forward}"
                      f"/bwd {checked.choice.prefetch.backward})")
        if c.peak_bytes <= ctx.budget_bytes:
            out.append(c)
    return out


def _solve_checked(ctx: _Context, space: SearchSpace, choice: GlobalChoice, hints: tuple = ()) -> Checked | None:
    """CP-SAT at the budget, then the simulators, which have the last word (bounded iterations).
    The simulators judge the solution and CP-SAT's last incumbents before it (near-optimal by the
    linear model, which cannot rank them finely: :data:`cpsat.INCUMBENTS_KEPT`); the fastest that fits
    is kept. Then:

    - the simulators reject the cover (peak over budget): cut it off and tighten the program's budget
      by the gap they observed;
    - they accept it with room to spare, or the program finds no cover at all: the linear model
      over-estimated; loosen the program's budget by the observed slack once (for no cover: by the
      over-estimate on the leanest cover, which must itself fit) and keep the faster accepted plan.

    Each solve at the budget is kept even when another global choice already measured the linear
    model's over-estimate: starting the second choice loosened by it saved 1 s on Llama 8B but found
    plans 0.4% (Llama 8B, 40GB) and 10% (ViT-L, 5GB) slower, since these time-limited solves land on
    different covers and the simulators rank them differently from the linear model.
    """
    budget_mib, budget_bytes = ctx.budget_mib, ctx.budget_bytes
    lm = ctx.linear(space, choice)
    effective = budget_mib
    forbidden: list[tuple[int, ...]] = []
    best: Checked | None = None
    loosened = False
    for attempt in range(MAX_RECHECKS + 1):
        hint = cpsat.greedy_cover(lm, effective)
        res = cpsat.solve_min_time(lm, effective, time_limit_s=ctx.time_limit_s, hint=hint, forbidden=forbidden,
                                   extra_hints=hints + ((best.cover,) if best else ()))
        if res.chosen is None:
            if loosened or best is not None:
                break
            low = cpsat.solve_min_peak(lm, time_limit_s=ctx.time_limit_s)
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
            if c.peak_bytes <= budget_bytes and (best is None or _speed(c) > _speed(best)):
                best = c
        sim_mib = math.ceil(checked.peak_bytes / MIB)
        if checked.peak_bytes <= budget_bytes:
            slack = budget_mib - sim_mib
            if loosened or slack <= max(1, budget_mib // 50):  # within 2%: not worth a re-solve
                break
            loosened = True
            effective = effective + slack
            continue
        logger.debug("%s: simulator peak %d MiB > budget %d MiB (linear said %d): re-solving", choice.label,
                     sim_mib, budget_mib, checked.linear_peak_mib)
        forbidden.append(res.chosen)
        effective = min(effective - 1, budget_mib - max(sim_mib - checked.linear_peak_mib, 0) - 1)
        if effective <= 0:
            break
    return best


def _sweep(ctx: _Context, best: Checked, points: int) -> list[Checked]:
    """Solve at ``points`` budgets from the smallest peak to that of the fastest cover, at the chosen
    global choice, and check each with the simulators. All but the fastest get a share of the time
    limit (``FRONTIER_TIME_SHARE``): they are for the frontier's plot first (the answer was solved
    at the budget), though the simulators may find one of them faster than the answer (U-Net base at
    2.2GB: 19.6 ms, where the answer's solve gave 19.9 ms)."""
    space = ctx.space(best.choice.mesh)
    lm = ctx.linear(space, best.choice)
    evaluated = []
    low = cpsat.solve_min_peak(lm, time_limit_s=ctx.time_limit_s * FRONTIER_TIME_SHARE)
    if low.chosen is not None:
        evaluated.append(ctx.check(lm, low.chosen, low.status))
    fastest = cpsat.solve_min_time(lm, 2**40 // MIB, time_limit_s=ctx.time_limit_s)
    if fastest.chosen is not None:
        evaluated.append(ctx.check(lm, fastest.chosen, fastest.status))
    if low.chosen is not None and fastest.chosen is not None and points > 2:
        lo, hi = low.objective, evaluate(lm, fastest.chosen).peak_mib
        for j in range(1, points - 1):
            b = lo + (hi - lo) * j // (points - 1)
            res = cpsat.solve_min_time(lm, b, time_limit_s=ctx.time_limit_s * FRONTIER_TIME_SHARE,
                                       hint=cpsat.greedy_cover(lm, b),
                                       extra_hints=tuple(c.cover for c in evaluated if c.cover is not None)
                                       + ((best.cover,) if best.cover is not None else ()))
            if res.chosen is not None:
                evaluated.append(ctx.check(lm, res.chosen, res.status))
    return evaluated


def _pareto(ctx: _Context, evaluated: list[Checked]) -> list[FrontierPoint]:
    """The Pareto set of (peak, step time) by the simulators' numbers over every plan evaluated."""
    pareto: list[Checked] = []
    for c in sorted(evaluated, key=lambda c: (c.peak_bytes, c.step_time_s)):
        if not pareto or c.step_time_s < pareto[-1].step_time_s:
            pareto.append(c)
    return [FrontierPoint(peak_bytes=c.peak_bytes, step_time_s=c.step_time_s,
                          description=(c.status + ": " if c.method in ("hand-written", "no-wrapping") else "")
                          + describe_choice(c.units, c.choice), fits=c.peak_bytes <= ctx.budget_bytes)
            for c in pareto]


def _hand_written(ctx: _Context, choice: GlobalChoice) -> list[Checked]:
    """The hand-written policies at the chosen micro-batch and mesh, FSDP2's default prefetch."""
    space = ctx.space(choice.mesh)
    base_choice = replace(choice, prefetch=Prefetch())
    return [ctx.check_units(policy(space), base_choice, name, method="hand-written") for name, policy in POLICIES]


def _root_resharded(ctx: _Context, found: list[Checked]) -> list[Checked]:
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


def _no_wrapping(ctx: _Context, choice: GlobalChoice) -> list[Checked]:
    """The whole model as one unit, the root, with no inner units: the fewest collectives and no
    per-unit hooks, often the fastest on small models; kept gathered from forward to backward (FSDP2's
    default for the root) and resharded after forward. The program cannot express it (repeated blocks
    are always units, :mod:`.space`), so it is judged here by the simulators, beside the policies."""
    base_choice = replace(choice, prefetch=Prefetch())  # nothing to prefetch: one unit
    return [ctx.check_units((Unit((ROOT,), reshard_after_forward=r),), base_choice,
                            f"no wrapping (the whole model one unit, root reshard {r})", method="no-wrapping")
            for r in (False, True)]


def describe_choice(units: tuple[Unit, ...], choice: GlobalChoice) -> str:
    """One line: units in compressed form and the global choices."""
    return f"{summarize_units(units, max_lines=3, sep='; ')}; {choice.label}"


def summarize_units(units: tuple[Unit, ...], *, max_lines: int = 8, sep: str | None = None):
    """Units compressed: runs of consecutive units with the same decisions and the same shape of name
    become one line, e.g. ``layers.0..31: 32 units, reshard True, no AC``. A list of lines, or one
    string joined by ``sep``."""
    import re

    def key(u: Unit):
        shape = tuple(re.sub(r"\d+", "#", m) for m in u.modules)
        return shape, u.reshard_after_forward, u.activation_checkpoint

    runs: list[list[Unit]] = []
    for u in units:
        if u.is_root:
            continue
        if runs and key(runs[-1][-1]) == key(u):
            runs[-1].append(u)
        else:
            runs.append([u])
    lines = []
    for run in runs:
        first, last = run[0], run[-1]
        name = first.name if len(run) == 1 else f"{first.modules[0]}..{last.modules[-1]}"
        size = f"{len(run)} unit{'s' if len(run) > 1 else ''}"
        if len(first.modules) > 1:
            size += f" of {len(first.modules)} modules"
        r = first.reshard_after_forward
        lines.append(f"{name}: {size}, reshard {r}, {'AC' if first.activation_checkpoint else 'no AC'}")
    root = next((u for u in units if u.is_root), None)
    if root is not None:
        lines.append(f"<root>: reshard {root.reshard_after_forward}")
    if len(lines) > max_lines:
        lines = lines[:max_lines - 1] + [f"... {len(lines) - max_lines + 1} more runs"]
    return sep.join(lines) if sep is not None else lines


def _smallest_peak(ctx: _Context, micro_batch: int) -> list[Checked]:
    """Per mesh and offload setting, the plan of least linear-model peak, judged by the simulators;
    with the hand-written baselines at the same choices (the linear model is an approximation, so
    another plan may have the smallest simulated peak)."""
    out: list[Checked] = []
    for mesh in _meshes(ctx.cluster.gpus, ctx.cluster.gpus_per_node):
        space = ctx.space(mesh)
        for offload in ((False, True) if ctx.allow_offload else (False,)):
            for pf in PREFETCH_CHOICES[:1]:  # deeper prefetch only adds memory
                choice = GlobalChoice(micro_batch, pf, mesh, offload)
                lm = ctx.linear(space, choice)
                res = cpsat.solve_min_peak(lm, time_limit_s=ctx.time_limit_s)
                if res.chosen is not None:
                    out.append(ctx.check(lm, res.chosen, res.status))
                out.extend(_hand_written(ctx, choice))
    return out


def _infeasible(ctx: _Context, micro_batch: int, smallest: list[Checked]) -> InfeasibleError:
    """The smallest budget any plan in the space needs (by the simulators; larger than the asked
    budget, else that plan would have been returned), that plan, and what dominates memory there."""
    fits = _budget_text(ctx.profile, ctx.cluster.mem_budget_bytes)
    best = min(smallest, key=lambda c: c.peak_bytes, default=None)
    if best is None:
        return InfeasibleError(f"no plan fits {fits} and the solver found no plan at all")
    at_peak = best.estimate.memory.memory_at_peak
    # What dominates among what a plan can change; the profile's fixed overhead (CUDA context, NCCL,
    # allocator reserve) only when it alone fills the budget, since no plan can shrink it.
    changeable = [k for k in at_peak if k != "overhead"]
    fixed_bytes = at_peak.get("overhead", 0)
    top = "overhead" if fixed_bytes >= ctx.budget_bytes or not changeable else max(changeable, key=at_peak.get)
    advice = {
        "activations": (f"try --batch-size {max(1, micro_batch // 2)}" if micro_batch > 1 else "add GPUs") + (
            "" if any(u.activation_checkpoint for u in best.units) else " or allow checkpointing"),
        "temporaries": f"try --batch-size {max(1, micro_batch // 2)}" if micro_batch > 1 else "add GPUs",
        "sharded_params": "add GPUs (sharded state divides by the shard group)",
        "optimizer_states": "add GPUs or use a lighter optimizer (sgd keeps no states)",
        "grads": "add GPUs",
        "unsharded_params": "add GPUs or split the largest unit",
        "comm_buffers": "lower the prefetch depth or split the largest unit",
        "overhead": "the profile's fixed overhead (context, NCCL, allocator reserve) alone exceeds the budget: "
                    "raise --mem or use a profile that matches your device",
    }.get(top, "add GPUs")
    need = ctx.profile.mem_for_tensor_budget(best.peak_bytes)
    over = (f", more than the {format_bytes(ctx.profile.memory_bytes)} of a {ctx.profile.name} device"
            if need > ctx.profile.memory_bytes else "")
    return InfeasibleError(
        f"no plan fits {fits}; the smallest budget any plan needs is {format_bytes(need)} (peak "
        f"{format_bytes(best.peak_bytes)}{over}; {describe_choice(best.units, best.choice)}); at its peak "
        f"{top.replace('_', ' ')} take {format_bytes(at_peak[top])} at micro-batch {micro_batch}: {advice}"
    )


def _budget_text(profile: HardwareProfile, mem_budget_bytes: int) -> str:
    """The budget in words, both numbers: '40.00 GiB per GPU (36.80 GiB usable of it: 8% kept for
    allocator fragmentation, profile h100-80gb)'."""
    given = min(mem_budget_bytes, profile.memory_bytes)
    usable = profile.tensor_budget_bytes(mem_budget_bytes)
    if usable == given:
        return f"{format_bytes(given)} per GPU"
    return (f"{format_bytes(given)} per GPU ({format_bytes(usable)} usable of it: {profile.fragmentation_percent}% "
            f"kept for allocator fragmentation, profile {profile.name})")
