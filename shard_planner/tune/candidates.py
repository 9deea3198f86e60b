"""The candidate plans ``tune`` runs: the top-K *distinct* plans that fit, by predicted step time.

Candidates come from two sources, pooled, deduplicated by what they decide
(:func:`~shard_planner.plan.measurement.plan_fingerprint`), checked against the budget with the cost model
and ranked by predicted step time:

1. the solver itself, re-solved under usable budgets below its plan's predicted peak (each tighter budget
   forces a different trade-off: more resharding, more checkpointing, smaller units), and
2. the neighbours of the solver's plan that the solver does not vary per unit: other prefetch depths
   (forward 0-2, backward 1-2), every unit resharding or every unit keeping its parameters, and
3. whatever else the caller adds (``tune_model`` adds the recipes of
   :mod:`shard_planner.plan.recipes` with the plan's global choices).

Plans the cost model cannot tell apart (same predicted peak and step time) teach the fit nothing and
differ, measured, only by noise: a candidate predicted exactly like a better-ranked one is taken only
when there are not ``count`` candidates without such a twin.

Every candidate keeps the caller's budget in its cluster section, whatever budget it was solved for, and the
plan's mesh, tensor-parallel degree and styles included: the re-solves are of the same trace (one rank at that
degree) and request, the neighbours and recipes are the plan with other units or prefetch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

from shard_planner.errors import InfeasibleError
from shard_planner.plan.measurement import plan_fingerprint
from shard_planner.plan import Plan, Prefetch
from shard_planner.plan.engine import SINGLE
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.trace.types import ModelTrace
from shard_planner.tune.judge import Judge

logger = logging.getLogger(__name__)

# Budgets the solver is re-run under, as fractions of its plan's predicted peak.
TIGHTER_BUDGET_FRACTIONS = (0.9, 0.75, 0.6, 0.45, 0.3)
PREFETCH_VARIANTS = tuple(Prefetch(forward=f, backward=b) for f in (0, 1, 2) for b in (1, 2))


@dataclass(frozen=True)
class Candidate:
    plan: Plan  # with its prediction under the profile it was ranked with
    source: str  # "solver", "solver at 70% budget", "prefetch f1/b2", ...

    @property
    def description(self) -> str:
        return describe_plan(self.plan)


def describe_plan(plan: Plan) -> str:
    """A short label of a plan's decisions: units (grouped), reshard mix, the root's reshard, AC, prefetch,
    micro-batch (two plans that differ only in the root's reshard get different labels)."""
    units = list(plan.inner_units)
    ac = sum(1 for u in plan.units if u.activation_checkpoint)
    if plan.engine == SINGLE:  # one device: regions checkpointed or not, nothing resharded or prefetched
        fused = ", optimizer in backward" if plan.training.optimizer_in_backward else ""
        return f"one device, {len(units)} regions, AC {ac}, mb {plan.training.micro_batch}{fused}"
    grouped = sum(1 for u in units if len(u.modules) > 1)
    def key(r) -> str:
        return ("T" if r else "F") if isinstance(r, bool) else str(r)

    reshard = {}
    for u in units:
        reshard[key(u.reshard_after_forward)] = reshard.get(key(u.reshard_after_forward), 0) + 1
    parts = [f"{len(units)}+root units" + (f" ({grouped} grouped)" if grouped else ""),
             "reshard " + ",".join(f"{k}:{v}" for k, v in sorted(reshard.items())) if reshard else "root only",
             f"root reshard {key(plan.root.reshard_after_forward)}",
             f"AC {ac}", f"pf {plan.prefetch.forward}/{plan.prefetch.backward}", f"mb {plan.training.micro_batch}"]
    if plan.training.cpu_offload:
        parts.append("offload")
    if plan.mesh.is_hsdp or plan.mesh.is_tp:
        parts.append(plan.mesh.description)
    return ", ".join(parts)


def _neighbours(plan: Plan) -> list[tuple[Plan, str]]:
    out = [(replace(plan, prefetch=p), f"prefetch {p.forward}/{p.backward}") for p in PREFETCH_VARIANTS
           if p != plan.prefetch]
    for keep in (True, False):
        units = tuple(u if u.is_root else replace(u, reshard_after_forward=keep) for u in plan.units)
        out.append((replace(plan, units=units), "all reshard" if keep else "all keep"))
    return out


def top_candidates(trace: ModelTrace, plan: Plan, profile: HardwareProfile, count: int, *,
                   solve: Callable[[int], Plan] | None,
                   estimate: Callable[[ModelTrace, Plan, HardwareProfile], object],
                   extra: list[tuple[Plan, str]] = ()) -> list[Candidate]:
    """Up to ``count`` distinct candidates that fit ``plan.cluster.mem_budget_bytes`` as the planner judges
    (their peak within ``profile.tensor_budget_bytes``, as the solver fills it, and on a GPU their simulated
    allocator surviving --mem: tune/judge.py [Note: tune judges as the planner]), the fastest predicted
    first, retries priced in; ``plan`` (the solver's answer) is always among them.
    ``solve(mem_budget_bytes)`` re-runs the solver at another --mem (None: no re-solving); ``estimate``
    is :func:`shard_planner.cost.estimate`."""
    budget = plan.cluster.mem_budget_bytes
    usable = profile.tensor_budget_bytes(budget)
    pool: list[tuple[Plan, str]] = [(plan, "solver")]
    if solve is not None:
        peak = plan.predicted.peak_bytes if plan.predicted is not None else usable
        for fraction in TIGHTER_BUDGET_FRACTIONS:
            try:
                # the --mem whose usable budget is ``fraction`` of the peak (the solver keeps the share free)
                tighter = solve(int(min(peak, usable) * fraction / profile.usable_fraction))
            except InfeasibleError as exc:
                logger.debug("no plan at %.0f%% of the peak: %s", fraction * 100, exc)
                continue
            pool.append((replace(tighter, cluster=replace(tighter.cluster, mem_budget_bytes=budget)),
                         f"solver at {fraction:.0%} of its peak"))
    pool.extend(_neighbours(plan))
    pool.extend(extra)

    judge = Judge(trace, estimate)
    seen: set[str] = set()
    ranked: list[Candidate] = []
    for p, source in pool:
        key = plan_fingerprint(p)
        if key in seen:
            continue
        seen.add(key)
        prediction, fits = judge.judged(p, profile, usable)
        if not fits and source != "solver":
            logger.debug("candidate %s does not fit --mem (peak %d of %d usable bytes, or its simulated allocator "
                         "runs out of memory)", source, prediction.peak_bytes, usable)
            continue
        ranked.append(Candidate(replace(p, predicted=prediction), source))
    first, rest = ranked[0], sorted(ranked[1:], key=lambda c: c.plan.predicted.step_time_s)
    # The solver's plan is kept even where another candidate is predicted faster (it is the answer to beat).
    chosen, twins = [first], []
    for c in rest:
        (twins if any(_twin(c, k) for k in chosen) else chosen).append(c)
    chosen = (chosen + twins)[:count]
    return sorted(chosen, key=lambda c: c.plan.predicted.step_time_s)


def _twin(a: Candidate, b: Candidate) -> bool:
    pa, pb = a.plan.predicted, b.plan.predicted
    return pa.peak_bytes == pb.peak_bytes and abs(pa.step_time_s - pb.step_time_s) <= 1e-9 * max(pb.step_time_s, 1e-12)
