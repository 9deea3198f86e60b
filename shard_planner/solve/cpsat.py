r"""CP-SAT segment program: the fastest exact cover of the items by candidate units that fits.

Sets (:mod:`.space`): items ``i = 0..n-1`` in forward order; candidates ``c`` = (segment
``[s_c, e_c)`` of sibling items, option); boundaries ``p = 0..n``. Coefficients (:mod:`.linear`,
integers: memory in MiB, time in µs): per candidate ``stack, fwd, copy, bwd, rs, gather, prev_out,
regather, rs_in, root, t``; constants ``base, loss, opt, pg`` (one extra process group); ``B`` the
budget; prefetch depths ``d_f, d_b`` (``d_b >= 1``: FSDP2 always prefetches one unit in backward).

Variables: ``x_c ∈ {0,1}`` (candidate chosen); ``A_p ∈ ℤ≥0`` (MiB live from the units that end at or
before ``p``); ``G ∈ ℤ≥0`` (the largest gathered unit; only matters when a depth exceeds 1);
``y ∈ {0,1}`` (some unit reshards to an int). Neighbour terms are linear expressions: for the unit
starting at ``q``, ``N_q = Σ_{c: s_c = q} gather_c x_c`` and ``S_q = Σ_{c: s_c = q} rs_in_c x_c``;
for the unit ending at ``p``, ``P_p = Σ_{c: e_c = p} prev_out_c x_c`` and ``E_p = Σ_{c: e_c = p}
regather_c x_c``. ``R = base + Σ_c root_c x_c + pg·y`` is live all step; ``F = (d_f − 1)⁺ G`` and
``H = (d_b − 1) G`` bound the extra units in flight with deeper prefetch.

    minimise   Σ_c t_c x_c                                                    (_set_time_objective)
    s.t.       Σ_{c ∋ i} x_c = 1                        ∀ i                  (_add_cover_constraint)
               A_0 = 0,  A_p = A_{p-1} + Σ_{c: e_c = p} stack_c x_c   ∀ p ≥ 1 (_add_stack_constraint)
               G ≥ gather_c x_c,  y ≥ x_c (c reshards to an int)             (_add_global_constraint)
               x_c ⇒ R + A_{s_c} + fwd_c  + [d_f ≥ 1] N_{e_c} + F ≤ B        (_add_forward_memory_constraint)
               x_c ⇒ R + A_{s_c} + copy_c + P_{s_c} + F ≤ B                  (_add_forward_memory_constraint)
               x_c ⇒ R + A_{s_c} + bwd_c  + E_{s_c} + S_{e_c} + H ≤ B        (_add_backward_memory_constraint)
               x_c ⇒ R + A_{s_c} + rs_c   + E_{s_c} + H ≤ B                  (_add_backward_memory_constraint)
               R + A_n + loss ≤ B,   opt ≤ B                                 (_add_step_memory_constraint)
               R + A_p + Σ_{c: s_c = p} m_c x_c ≤ B  ∀ p, m ∈ {fwd, copy, bwd, rs}  (_add_boundary_cut)

Each implication is the memory at one event of unit ``c`` in the schedule the cost model simulates:
its forward compute (with the next unit's prefetched all-gather output), its copy-out (with the
previous unit's all-gather output), its backward compute (with the previous unit re-gathered by
backward prefetch and the next unit's reduce-scatter input), its reduce-scatter; then the loss (every
saved activation live) and the optimizer step. ``A_{s_c}`` is what every earlier unit left behind.
Implications are CP-SAT enforcement literals (``only_enforce_if``), not big-M; the boundary cuts
are the same constraints without their neighbour terms, valid without enforcement because at most one
unit starts at a boundary — redundant, they give the LP relaxation the memory structure. The peak of one cover
under these constraints is exactly :func:`shard_planner.solve.linear.evaluate`, which the DP and the
brute force use too. The linearisation of the objective is in :mod:`.linear` (per-unit exposed
communication ``max(0, comm − depth × compute)``, a constant per candidate).

``minimise_peak`` swaps the objective for the smallest ``B`` any cover fits (``B`` becomes a
variable): the infeasibility answer. A greedy cover (:func:`greedy_cover`) is the hint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from shard_planner.solve.item_peaks import ItemCoverPeaks
from shard_planner.solve.linear import LinearModel, LinearResult, evaluate
from shard_planner.solve.request import DEFAULT_TIME_LIMIT_S

logger = logging.getLogger(__name__)

# Stop when the incumbent is proven within this fraction of the optimum (the status then says
# FEASIBLE with the gap, never OPTIMAL). The linear model's own error against the simulators is
# larger than this; tests that compare with the DP and the brute force pass 0. Measured with
# benchmarks/bench_plan.py (quiet machine, with the polish step): 0.002 -> 0.005 cut Llama 8B/8/40GB's
# solve from 7.9 s to 4.8 s, every case's plan the same but Llama 8B/30GB (+0.4% step time); 0.01 gave
# 2.7 s but plans up to 3.2% slower (ViT-L 5GB), so not that.
DEFAULT_RELATIVE_GAP = 0.005


# Besides the best, the solver returns this many of the last incumbents it improved on (near-optimal
# covers): the linear model's time is a few percent off the simulators' and ranks covers within a
# fraction of a percent of each other at random (Llama 8B at 40GB: objectives 0.01% apart simulate
# 1.6% apart), so the planner lets the simulators pick among them.
INCUMBENTS_KEPT = 4

# [Note: deterministic time limits] A solve stops after ``time_limit_s`` x DETERMINISTIC_S_PER_S of
# CP-SAT's deterministic time (a count of work, the same on every run), so the plan does not depend
# on the machine's load: with one worker and a deterministic limit CP-SAT returns the same cover for
# the same model. Measured on this 2-core machine (Llama 8B's program): 0.05 deterministic s per wall
# second at load 7. 0.05 per second of limit: on bench_plan's 12 cases (with the polish and regrouping
# steps after it) 0.1 found Llama 8B/30GB's plan 1% faster for about 0.5 s more CPU per solve, 0.03
# found three plans 1-6% slower. The wall clock still bounds each solve at WALL_LIMIT_FACTOR x ``time_limit_s``
# (a guard; only on a very busy machine may the plan then differ).
DETERMINISTIC_S_PER_S = 0.05
WALL_LIMIT_FACTOR = 3.0


@dataclass(frozen=True)
class SolveResult:
    chosen: tuple[int, ...] | None  # candidate indices in forward order; None when infeasible
    status: str  # CP-SAT status name
    objective: int | None  # µs (time) or MiB (minimise_peak)
    seconds: float
    runners_up: tuple[tuple[int, ...], ...] = ()  # earlier incumbents, best first (each a cover that fits)


class _Incumbents(cp_model.CpSolverSolutionCallback):
    """The last ``keep`` solutions CP-SAT found, as sorted candidate indices."""

    def __init__(self, x, keep: int):
        super().__init__()
        self.x, self.keep, self.covers = x, keep, []

    def on_solution_callback(self) -> None:
        self.covers.append(tuple(k for k, v in enumerate(self.x) if self.boolean_value(v)))
        del self.covers[:-self.keep]


class _Program:
    """One CP-SAT model over a linear model; the ``_add_*`` methods add one constraint family each."""

    def __init__(self, lm: LinearModel, a_upper_mib: int | None = None):
        self.lm = lm
        self.m = cp_model.CpModel()
        cands = lm.space.candidates
        self.x = [self.m.new_bool_var(f"x{k}") for k in range(len(cands))]
        self._cache: dict = {}
        self.starting = [[] for _ in range(lm.space.n + 1)]
        self.ending = [[] for _ in range(lm.space.n + 1)]
        for k, c in enumerate(cands):
            self.starting[c.start].append(k)
            self.ending[c.stop].append(k)
        total_stack = sum(co.stack_mib for co in lm.coeffs)
        if a_upper_mib is not None:  # every memory constraint has R + A_p ≤ B with R ≥ base
            total_stack = max(0, min(total_stack, a_upper_mib))
        self.A = [self.m.new_int_var(0, total_stack, f"A{p}") for p in range(lm.space.n + 1)]
        self.G = self.m.new_int_var(0, max((co.gather_mib for co in lm.coeffs), default=0), "G")
        self.y = self.m.new_bool_var("y_int_reshard")
        root_terms = [(co.root_mib, self.x[k]) for k, co in enumerate(lm.coeffs) if co.root_mib]
        self.root_extra = lm.process_group_mib * self.y
        if root_terms:
            root = self.m.new_int_var(0, sum(a for a, _ in root_terms), "root")
            self.m.add(root == sum(a * v for a, v in root_terms))
            self.root_extra = root + self.root_extra

    def _boundary_var(self, name: str, p: int, ks: list[int], field: str):
        """An integer variable equal to Σ_{k ∈ ks} field_k x_k (one per boundary and neighbour term,
        so that each implication stays short)."""
        key = (field, p)
        if key not in self._cache:
            terms = [(getattr(self.lm.coeffs[k], field), self.x[k]) for k in ks]
            terms = [(a, v) for a, v in terms if a]
            if not terms:
                self._cache[key] = 0
            else:
                var = self.m.new_int_var(0, max(a for a, _ in terms), f"{name}{p}")
                self.m.add(var == sum(a * v for a, v in terms))
                self._cache[key] = var
        return self._cache[key]

    def _sum(self, ks: list[int], field: str):
        p = self.lm.space.candidates[ks[0]].start if ks and field in ("gather_mib", "rs_in_mib") else (
            self.lm.space.candidates[ks[0]].stop if ks else -1)
        return self._boundary_var(field[0], p, ks, field) if ks else 0

    def R(self):
        return self.lm.base_mib + self.root_extra

    def _add_cover_constraint(self) -> None:
        """Σ_{c ∋ i} x_c = 1 for every item i: every item is in exactly one unit (or the root)."""
        covering = [[] for _ in range(self.lm.space.n)]
        for k, c in enumerate(self.lm.space.candidates):
            for i in range(c.start, c.stop):
                covering[i].append(k)
        for i, ks in enumerate(covering):
            self.m.add_exactly_one(self.x[k] for k in ks)

    def _add_stack_constraint(self) -> None:
        """A_0 = 0; A_p = A_{p-1} + Σ_{c: e_c = p} stack_c x_c: memory earlier units leave behind."""
        self.m.add(self.A[0] == 0)
        for p in range(1, self.lm.space.n + 1):
            self.m.add(self.A[p] == self.A[p - 1] + sum(self.lm.coeffs[k].stack_mib * self.x[k] for k in self.ending[p]))

    def _add_global_constraint(self) -> None:
        """G ≥ gather_c x_c (largest gathered unit); y ≥ x_c for units that reshard to an int."""
        for k, co in enumerate(self.lm.coeffs):
            if co.gather_mib:
                self.m.add(self.G >= co.gather_mib * self.x[k])
            if co.uses_int_reshard:
                self.m.add_implication(self.x[k], self.y)

    def _add_forward_memory_constraint(self, budget) -> None:
        """x_c ⇒ R + A_{s_c} + fwd_c + [d_f ≥ 1] N_{e_c} + F ≤ B  (forward compute) and
        x_c ⇒ R + A_{s_c} + copy_c + P_{s_c} + F ≤ B  (copy-out)."""
        lm = self.lm
        extra = max(0, lm.forward_depth - 1) * self.G if lm.forward_depth > 1 else 0
        for k, c in enumerate(lm.space.candidates):
            co = lm.coeffs[k]
            compute = self.R() + self.A[c.start] + co.fwd_mib + extra
            if lm.forward_depth >= 1:
                compute = compute + self._sum(self.starting[c.stop], "gather_mib")
            self.m.add(compute <= budget).only_enforce_if(self.x[k])
            copy = self.R() + self.A[c.start] + co.copy_mib + self._sum(self.ending[c.start], "prev_out_mib") + extra
            self.m.add(copy <= budget).only_enforce_if(self.x[k])

    def _add_backward_memory_constraint(self, budget) -> None:
        """x_c ⇒ R + A_{s_c} + bwd_c + E_{s_c} + S_{e_c} + H ≤ B  (backward compute) and
        x_c ⇒ R + A_{s_c} + rs_c + E_{s_c} + H ≤ B  (reduce-scatter)."""
        lm = self.lm
        extra = (lm.backward_depth - 1) * self.G if lm.backward_depth > 1 else 0
        for k, c in enumerate(lm.space.candidates):
            co = lm.coeffs[k]
            regather = self._sum(self.ending[c.start], "regather_mib")
            compute = (self.R() + self.A[c.start] + co.bwd_mib + regather + extra
                       + self._sum(self.starting[c.stop], "rs_in_mib"))
            self.m.add(compute <= budget).only_enforce_if(self.x[k])
            rs = self.R() + self.A[c.start] + co.rs_mib + regather + extra
            self.m.add(rs <= budget).only_enforce_if(self.x[k])

    def _add_boundary_cut(self, budget) -> None:
        """Redundant cuts for a tighter LP relaxation: at most one unit starts at a boundary, so
        R + A_p + Σ_{c: s_c = p} m_c x_c ≤ B for m ∈ {fwd, copy, bwd, rs} (the implications with
        their neighbour terms dropped, which are ≥ 0) hold without enforcement literals."""
        lm = self.lm
        for p in range(lm.space.n):
            for field in ("fwd_mib", "copy_mib", "bwd_mib", "rs_mib"):
                self.m.add(self.R() + self.A[p] + sum(getattr(lm.coeffs[k], field) * self.x[k]
                                                      for k in self.starting[p]) <= budget)

    def _add_step_memory_constraint(self, budget) -> None:
        """R + A_n + loss ≤ B (every saved activation is live when the loss runs); opt ≤ B."""
        self.m.add(self.R() + self.A[self.lm.space.n] + self.lm.loss_mib <= budget)
        self.m.add(self.lm.optimizer_mib <= budget)

    def _set_time_objective(self) -> None:
        """minimise Σ_c t_c x_c (the constant part of the step time does not change the argmin)."""
        self.m.minimize(sum(co.time_us * self.x[k] for k, co in enumerate(self.lm.coeffs)))

    def add_hint(self, chosen: tuple[int, ...] | None) -> None:
        if chosen is None:
            return
        picked = set(chosen)
        for k, var in enumerate(self.x):
            self.m.add_hint(var, k in picked)

    def forbid(self, covers: list[tuple[int, ...]]) -> None:
        """No-good cuts: Σ_{c ∈ cover} x_c ≤ |cover| − 1 (a cover the simulator rejected)."""
        for cover in covers:
            self.m.add(sum(self.x[k] for k in cover) <= len(cover) - 1)

    def run(self, time_limit_s: float, relative_gap: float = 0.0):
        """(status, status name, chosen cover, objective, runners-up: earlier incumbents, best first)."""
        solver = cp_model.CpSolver()
        # See [Note: deterministic time limits]
        solver.parameters.max_deterministic_time = time_limit_s * DETERMINISTIC_S_PER_S
        solver.parameters.max_time_in_seconds = time_limit_s * WALL_LIMIT_FACTOR
        solver.parameters.relative_gap_limit = relative_gap
        solver.parameters.num_workers = 1  # deterministic: same inputs, same plan
        solver.parameters.random_seed = 0
        # A stronger LP relaxation of the enforced memory constraints: on an 80-block stack it closes
        # the gap to ~0.1% in seconds where the default level stalls at ~20%.
        solver.parameters.linearization_level = 2
        # Presolve (probing above all) spends seconds on this model and gains nothing the boundary cuts
        # have not given already: on Llama 8B at 40GB, 1 s without presolve reaches a 0.02% gap, with
        # it no solution at all.
        solver.parameters.cp_model_presolve = False
        # Core-based search (optimize_with_core) proves gaps faster on Llama 70B but returned a plan 6%
        # slower by the simulators on gpt2-xl at 7GB, and none in 1 s for the peak objective: not used.
        incumbents = _Incumbents(self.x, INCUMBENTS_KEPT + 1)
        status = solver.solve(self.m, incumbents)
        name = solver.status_name(status)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return status, name, None, None, ()
        gap = abs(solver.objective_value - solver.best_objective_bound) / max(abs(solver.objective_value), 1e-9)
        if status == cp_model.FEASIBLE or gap > 0:
            name = f"FEASIBLE (gap {100 * gap:.2f}%)"
        order = lambda cover: tuple(sorted(cover, key=lambda k: self.lm.space.candidates[k].start))  # noqa: E731
        chosen = order(k for k, v in enumerate(self.x) if solver.boolean_value(v))
        runners_up = tuple(order(c) for c in reversed(incumbents.covers) if order(c) != chosen)
        return status, name, chosen, round(solver.objective_value), runners_up


def solve_min_time(lm: LinearModel, budget_mib: int, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                   hint: tuple[int, ...] | None = None, forbidden: list[tuple[int, ...]] = (),
                   relative_gap: float = DEFAULT_RELATIVE_GAP, extra_hints: tuple = ()) -> SolveResult:
    """The fastest cover whose linear peak is at most ``budget_mib``; the hint is the fastest that
    fits of ``hint`` (usually :func:`greedy_cover`) and ``extra_hints`` (e.g. a neighbouring solve's)."""
    t0 = time.perf_counter()
    prog = _Program(lm, a_upper_mib=budget_mib - lm.base_mib)
    prog._add_cover_constraint()
    prog._add_stack_constraint()
    prog._add_global_constraint()
    prog._add_forward_memory_constraint(budget_mib)
    prog._add_backward_memory_constraint(budget_mib)
    prog._add_step_memory_constraint(budget_mib)
    prog._set_time_objective()
    prog._add_boundary_cut(budget_mib)
    prog.forbid(list(forbidden))
    fitting = [h for h in (hint, *extra_hints) if h is not None and h not in forbidden
               and evaluate(lm, h).peak_mib <= budget_mib]
    best_hint = min(fitting, key=lambda h: evaluate(lm, h).time_us) if fitting else None
    if best_hint is not None:
        prog.add_hint(best_hint)
    _, name, chosen, obj, runners_up = prog.run(time_limit_s, relative_gap)
    if chosen is None and best_hint is not None:
        # out of time before CP-SAT completed the hint: the hint is feasible for the same program
        chosen, obj = best_hint, evaluate(lm, best_hint).time_us - lm.const_time_us
        name = f"{name} in {time_limit_s:g} s: the heuristic hint"
    secs = time.perf_counter() - t0
    logger.debug("cp-sat min time (%s, budget %d MiB): %s in %.3f s", lm.choice.label, budget_mib, name, secs)
    return SolveResult(chosen=chosen, status=name, objective=None if obj is None else obj + lm.const_time_us,
                       seconds=secs, runners_up=runners_up)


def solve_min_peak(lm: LinearModel, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                   relative_gap: float = DEFAULT_RELATIVE_GAP) -> SolveResult:
    """The cover with the smallest linear peak (ties: no preference): the infeasibility answer."""
    t0 = time.perf_counter()
    prog = _Program(lm)
    upper = lm.base_mib + lm.optimizer_mib + lm.process_group_mib + lm.loss_mib + sum(
        co.root_mib + co.stack_mib + co.fwd_mib + co.copy_mib + co.bwd_mib + co.rs_mib + co.gather_mib
        + co.prev_out_mib + co.regather_mib + co.rs_in_mib for co in lm.coeffs) * 4
    budget = prog.m.new_int_var(0, upper, "B")
    prog._add_cover_constraint()
    prog._add_stack_constraint()
    prog._add_global_constraint()
    prog._add_forward_memory_constraint(budget)
    prog._add_backward_memory_constraint(budget)
    prog._add_step_memory_constraint(budget)
    prog.m.minimize(budget)
    frugal = frugal_cover(lm)
    prog.add_hint(frugal)
    _, name, chosen, obj, _ = prog.run(time_limit_s, relative_gap)
    if chosen is None:  # out of time: the frugal cover is a valid (not proven smallest) answer
        chosen, obj = frugal, evaluate(lm, frugal).peak_mib
        name = f"{name} in {time_limit_s:g} s: the frugal cover"
    secs = time.perf_counter() - t0
    logger.debug("cp-sat min peak (%s): %s in %.3f s", lm.choice.label, name, secs)
    return SolveResult(chosen=chosen, status=name, objective=obj, seconds=secs)


def _singles(lm: LinearModel) -> dict[int, list[int]]:
    singles: dict[int, list[int]] = {}
    for k, c in enumerate(lm.space.candidates):
        if c.stop == c.start + 1:
            singles.setdefault(c.start, []).append(k)
    return singles


def frugal_cover(lm: LinearModel) -> tuple[int, ...]:
    """One unit per item, each with the option that leaves the least behind (checkpointed, resharded)."""
    singles = _singles(lm)
    return tuple(min(singles[i], key=lambda k: (lm.coeffs[k].stack_mib + lm.coeffs[k].bwd_mib, lm.coeffs[k].time_us, k))
                 for i in range(lm.space.n))


def _shortest_paths(lm: LinearModel, prices: list[float]) -> list[tuple[int, ...]]:
    """Per price λ, the cover minimising Σ_c (t_c + λ·(stack_c + root_c + gather_c)) x_c: a shortest path
    over the boundaries 0..n, each candidate an edge from its start to its stop. All prices at once, one
    boundary at a time (arrays of prices x candidates ending there); ties go to the first candidate in
    the space's order, as a scan with a strict ``<`` would, and every sum is the scan's, in its order."""
    cands = lm.space.candidates
    by_stop: list[list[int]] = [[] for _ in range(lm.space.n + 1)]
    for k, c in enumerate(cands):
        by_stop[c.stop].append(k)
    lam = np.asarray(prices, dtype=np.float64)[:, None]
    cost = np.full((len(prices), lm.space.n + 1), np.inf)
    cost[:, 0] = 0.0
    back = np.full((len(prices), lm.space.n + 1), -1, dtype=np.int64)
    for p in range(1, lm.space.n + 1):
        ks = by_stop[p]
        if not ks:
            continue
        starts = np.array([cands[k].start for k in ks])
        t = np.array([float(lm.coeffs[k].time_us) for k in ks])
        m = np.array([float(lm.coeffs[k].stack_mib + lm.coeffs[k].root_mib + lm.coeffs[k].gather_mib) for k in ks])
        v = cost[:, starts] + t + lam * m
        best = np.argmin(v, axis=1)
        cost[:, p] = v[np.arange(len(prices)), best]
        back[:, p] = np.asarray(ks)[best]
    covers = []
    for row in back:
        cover, p = [], lm.space.n
        while p > 0:
            cover.append(int(row[p]))
            p = cands[row[p]].start
        covers.append(tuple(reversed(cover)))
    return covers


def fastest_cover(lm: LinearModel) -> tuple[int, ...]:
    """The fastest cover with no memory limit: the program's optimum without its memory constraints
    (the objective Σ_c t_c x_c over exact covers is a shortest path), exact, in milliseconds."""
    return _shortest_paths(lm, [0.0])[0]


# λ (µs per MiB left behind) for the Lagrangian heuristic: 0 and 10^(-2)..10^7 in quarter decades.
LAGRANGE_PRICES = [0.0, *(10 ** (e / 4) for e in range(-8, 29))]


def lagrangian_paths(lm: LinearModel) -> tuple[tuple[int, ...], ...]:
    """The distinct minimisers of :func:`lagrangian_cover`'s prices, in the prices' order (the first of
    equal ones kept). They read only the candidates' terms (not ``base``: the same with any accumulation)."""
    return tuple(dict.fromkeys(_shortest_paths(lm, LAGRANGE_PRICES)))


def lagrangian_covers(lm: LinearModel,
                      paths: tuple[tuple[int, ...], ...] | None = None) -> tuple[tuple[tuple[int, ...], LinearResult], ...]:
    """:func:`lagrangian_paths` (``paths``: the caller's, of a model with the same candidates' terms; None:
    computed here), each with its :func:`evaluate`: what :func:`lagrangian_cover` filters by the budget,
    the same at every budget (the planner keeps them per linear model: solve/context.py ``PlanContext.greedy``)."""
    return tuple((cover, evaluate(lm, cover)) for cover in (paths if paths is not None else lagrangian_paths(lm)))


def lagrangian_cover(lm: LinearModel, budget_mib: int,
                     covers: tuple[tuple[tuple[int, ...], LinearResult], ...] | None = None) -> tuple[int, ...] | None:
    """The fastest fitting cover among the minimisers of Σ_c (t_c + λ·(stack_c + root_c + gather_c)) x_c over a grid
    of prices λ (:data:`LAGRANGE_PRICES`): each is a shortest path over the boundaries, O(candidates).
    The memory constraint relaxed into the objective (a Lagrangian heuristic, as for knapsacks); the
    result is checked against every constraint with :func:`evaluate`. None when no price gives a fit.
    ``covers``: :func:`lagrangian_covers` of ``lm``, when the caller kept them (None: computed here)."""
    best = None
    for cover, res in covers if covers is not None else lagrangian_covers(lm):
        if res.peak_mib <= budget_mib and (best is None or res.time_us < best[1]):
            best = (cover, res.time_us)
    return None if best is None else best[0]


def greedy_cover(lm: LinearModel, budget_mib: int,
                 covers: tuple[tuple[tuple[int, ...], LinearResult], ...] | None = None) -> tuple[int, ...] | None:
    """The hint: the faster of :func:`lagrangian_cover` (``covers``: as there) and :func:`item_greedy_cover`."""
    found = [c for c in (lagrangian_cover(lm, budget_mib, covers), item_greedy_cover(lm, budget_mib)) if c is not None]
    return min(found, key=lambda c: evaluate(lm, c).time_us) if found else None


def uniform_covers(lm: LinearModel) -> dict[str, tuple[int, ...]]:
    """Per option (by its label), the cover that gives every item one unit with that option (the shape
    of most recipes: one unit per block, all resharded and checkpointed alike) where the
    item offers it, and the most frugal option elsewhere (an embedding that offers no checkpointing).
    A handful of covers for the simulators to judge directly (solve/planner.py): the linear model
    bounds selective checkpointing's memory loosely (every stash counted at every block's backward
    peak), so its budget can turn away a uniform cover that fits (Llama 3 8B / 8 GPUs / 40GB: every
    block selective, 44,333 MiB by the linear model, 33,409 MiB and 629 ms by the simulators, where
    the heuristic hint it ranked first runs 745 ms)."""
    singles, frugal = _singles(lm), frugal_cover(lm)
    options = dict.fromkeys(lm.space.candidates[k].option for ks in singles.values() for k in ks)
    return {o.label: tuple(next((k for k in singles[i] if lm.space.candidates[k].option == o), frugal[i])
                           for i in range(lm.space.n)) for o in options}


def item_greedy_cover(lm: LinearModel, budget_mib: int) -> tuple[int, ...] | None:
    """A quick feasible cover for the hint: one unit per item, then, item by item, the fastest option
    that still fits (starting from the most memory-frugal), and finally the same for runs of items.
    None when even the most frugal single-item cover does not fit."""
    singles = _singles(lm)
    frugal = frugal_cover(lm)
    if evaluate(lm, frugal).peak_mib > budget_mib:
        return None
    peaks = ItemCoverPeaks(lm, frugal)  # holds the cover; each trial's peak in O(1): solve/item_peaks.py
    for i in range(lm.space.n):
        best = peaks.cover[i]
        for k in sorted(singles[i], key=lambda k: (lm.coeffs[k].time_us, k)):
            if lm.coeffs[k].time_us >= lm.coeffs[best].time_us:
                break
            if peaks.with_item(i, k) <= budget_mib:
                best = k
                break
        peaks.set(i, best)
    return tuple(peaks.cover)
