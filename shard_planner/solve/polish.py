"""``polish``: a simulator-guided local search from the planner's chosen plan.

The planner picks its answer among a handful of candidates the linear program proposes; when the
linear model is off, a faster plan is often one small move away. ``polish`` climbs greedily: each pass
evaluates the plans one move away with the full simulators (:func:`shard_planner.cost.estimate`, no
memory timeline), takes the fastest that fits the budget and improves the step time by more than
``MIN_GAIN``, and stops when none does or the time budget is spent (an anytime search: a pass cut short
still takes the best move it has seen).

Moves (:func:`neighbours`), each of which keeps the plan one FSDP2 and :func:`shard_planner.execute.apply_plan`
accept — units are whole modules of the plan, grouped units are consecutive siblings in registration
order (``ModuleTrace.children``), no unit splits a group of tied parameters (``ModuleTrace.tied_with``,
checked on every result), the root unit stays, and no checkpointed unit nests in another:

1. drop an inner unit (its parameters go to the enclosing unit, or the root);
2. toggle one unit's ``reshard_after_forward`` True <-> False (the root included; int reshards stay);
3. toggle one inner unit's activation checkpointing;
4. merge two units of consecutive siblings into one grouped unit (at most ``max_group_size`` modules,
   with either unit's options), or split a grouped unit into one unit per module;
5. forward or backward prefetch depth +-1, within the planner's bounds.

Deep models have hundreds of neighbours; a pass evaluates first the global moves (prefetch, the root)
and the moves on units next to those the last move changed, then the rest in a fixed shuffled order,
so a time-limited pass samples the whole model rather than its first blocks.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace
from typing import Callable

from shard_planner.plan.checkpointing import DEFAULT_SAVE_OPS, SELECTIVE
from shard_planner.cost.selective import keeps_something, supports_selective
from shard_planner.cost.types import Estimate
from shard_planner.plan import ROOT, Plan, Prefetch, Unit
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.solve.space import DEFAULT_MAX_GROUP_SIZE, checkpointing_allowed, first_calls
from shard_planner.trace.types import ModelTrace

logger = logging.getLogger(__name__)

MIN_GAIN = 1e-3  # a move must cut the step time by more than 0.1%: below that the simulators' ranking is noise
SHUFFLE_SEED = 0  # the order of the non-priority moves: fixed, so that a given time budget gives one answer


@dataclass(frozen=True)
class Move:
    """One neighbour: its description, the plan's new units and prefetch, and the modules of the units
    it changed (the next pass looks near them first)."""

    description: str
    units: tuple[Unit, ...]
    prefetch: Prefetch
    touched: frozenset[str]  # FQNs of the modules of the units the move changed
    is_global: bool = False


@dataclass(frozen=True)
class PolishInfo:
    """What the search did: the moves taken, the step times before and after, how many plans it
    evaluated, its wall time, and why it stopped ("converged", "time budget" or "evaluation budget")."""

    moves: tuple[str, ...]
    start_step_time_s: float
    step_time_s: float
    evaluated: int
    seconds: float
    stopped: str

    @property
    def gain(self) -> float:
        """Relative step-time change, negative when faster (-0.054 for -5.4%)."""
        return self.step_time_s / self.start_step_time_s - 1 if self.start_step_time_s > 0 else 0.0


def polish(trace: ModelTrace, plan: Plan, profile: HardwareProfile, budget_bytes: int, *, time_budget_s: float,
           max_group_size: int = DEFAULT_MAX_GROUP_SIZE,
           prefetch_bounds: tuple[Prefetch, Prefetch] = (Prefetch(0, 1), Prefetch(2, 2)),
           estimate: Callable[[Plan], Estimate] | None = None,
           max_evaluations: int | None = None) -> tuple[Plan, PolishInfo]:
    """Hill-climb from ``plan`` (which should fit ``budget_bytes``, the planner's usable budget,
    ``profile.tensor_budget_bytes(--mem)``) for at most ``time_budget_s``. Returns the best plan found,
    never over budget (unless ``plan`` itself was) nor slower than ``plan``, without a prediction, and
    what the search did. ``prefetch_bounds``: the lowest and the highest depths, forward and backward.
    ``estimate``: how a plan is judged (the planner passes its memo, ``PlanContext.estimate``); by
    default the cost model's simulators without the memory timeline. ``max_evaluations``: stop after
    judging this many distinct plans (a budget that, unlike the time budget, gives the same answer on
    a busy machine)."""
    if estimate is None:
        from shard_planner.cost.model import CostModel  # the cost model; as in .simulate

        cost_model = CostModel(trace, profile)  # one for the whole search: it reuses tables between moves

        def estimate(p: Plan) -> Estimate:
            return cost_model.estimate(p, timeline=False)

    t0 = time.perf_counter()
    deadline = t0 + max(0.0, time_budget_s)
    cache: dict[tuple, tuple[float, int]] = {}

    def judge(units: tuple[Unit, ...], prefetch: Prefetch) -> tuple[float, int]:
        key = (units, prefetch)
        if key not in cache:
            est = estimate(replace(plan, units=units, prefetch=prefetch))
            cache[key] = (est.time.step_time_s, est.memory.peak_bytes)
        return cache[key]

    units, prefetch = plan.units, plan.prefetch
    start_s, _ = judge(units, prefetch)
    current_s = start_s
    taken: list[str] = []
    touched: frozenset[str] = frozenset()
    rng = random.Random(SHUFFLE_SEED)
    stopped = "converged"
    first = first_calls(trace)  # once: every move orders its units by it
    while True:
        moves = neighbours(trace, units, prefetch, max_group_size=max_group_size, prefetch_bounds=prefetch_bounds,
                           first=first)
        moves = _prioritised(moves, units, touched, rng)
        best: tuple[float, int, Move] | None = None
        out_of_time = ""
        for move in moves:
            if time.perf_counter() > deadline:
                out_of_time = "time budget"
            elif max_evaluations is not None and len(cache) >= max_evaluations:
                out_of_time = "evaluation budget"
            if out_of_time:
                break
            step_s, peak = judge(move.units, move.prefetch)
            if peak > budget_bytes or step_s >= current_s * (1 - MIN_GAIN):
                continue
            if best is None or (step_s, peak) < best[:2]:
                best = (step_s, peak, move)
        if best is None:
            stopped = out_of_time or "converged"
            break
        current_s, _, move = best
        units, prefetch, touched = move.units, move.prefetch, move.touched
        taken.append(move.description)
        logger.debug("polish: %s -> %.4g s", move.description, current_s)
        if out_of_time:
            stopped = out_of_time
            break
    info = PolishInfo(moves=tuple(taken), start_step_time_s=start_s, step_time_s=current_s, evaluated=len(cache),
                      seconds=time.perf_counter() - t0, stopped=stopped)
    logger.debug("polish: %d move(s), %.2f%% step time, %d plans evaluated in %.2f s (%s)", len(taken),
                 100 * info.gain, info.evaluated, info.seconds, stopped)
    return replace(plan, units=units, prefetch=prefetch, predicted=None), info


def neighbours(trace: ModelTrace, units: tuple[Unit, ...], prefetch: Prefetch, *,
               max_group_size: int = DEFAULT_MAX_GROUP_SIZE,
               prefetch_bounds: tuple[Prefetch, Prefetch] = (Prefetch(0, 1), Prefetch(2, 2)),
               first: dict[str, float] | None = None) -> list[Move]:
    """Every plan one move away (see the module docstring), valid by construction and checked for tied
    parameters; in a fixed order (global moves first). ``first``: ``space.first_calls(trace)`` (computed
    when not given)."""
    first = first_calls(trace) if first is None else first
    moves: list[Move] = []
    lo, hi = prefetch_bounds
    for direction in ("forward", "backward"):
        depth = getattr(prefetch, direction)
        for d in (depth - 1, depth + 1):
            if getattr(lo, direction) <= d <= getattr(hi, direction):
                moves.append(Move(f"prefetch {direction} {depth} -> {d}", units, replace(prefetch, **{direction: d}),
                                  frozenset(), is_global=True))

    def move(description: str, new_units: list[Unit], touched_units: list[Unit], is_global: bool = False) -> None:
        ordered = in_forward_order(first, new_units)
        if _ties_intact(trace, ordered):
            moves.append(Move(description, ordered, prefetch,
                              frozenset(m for u in touched_units for m in u.modules), is_global))

    checkpointed = [u for u in units if u.activation_checkpoint]
    ac_modes = ((False,) if not checkpointing_allowed(trace) else
                (False, True, SELECTIVE) if supports_selective(trace) else (False, True))
    for i, u in enumerate(units):
        others = list(units[:i]) + list(units[i + 1:])
        r = u.reshard_after_forward
        if isinstance(r, bool):
            v = replace(u, reshard_after_forward=not r)
            move(f"{u.name}: reshard after forward {r} -> {not r}", others + [v], [v], is_global=u.is_root)
        if u.is_root:
            continue
        move(f"drop unit {u.name}", others, [u])
        if u.activation_checkpoint or not any(_nests(u, c) or _nests(c, u) for c in checkpointed if c != u):
            for ac in ac_modes:
                if ac != u.activation_checkpoint and (ac != SELECTIVE or any(
                        keeps_something(trace, m, DEFAULT_SAVE_OPS) for m in u.modules)):
                    v = Unit(u.modules, u.reshard_after_forward, ac)
                    move(f"{u.name}: activation checkpointing {u.activation_checkpoint} -> {ac}", others + [v], [v])
        if len(u.modules) > 1:
            parts = [replace(u, modules=(m,)) for m in u.modules]
            move(f"split unit {u.name} into {len(parts)}", others + parts, parts)
    by_first = {u.modules[0]: u for u in units if not u.is_root}
    for u in units:
        if u.is_root:
            continue
        nxt = _next_sibling(trace, u.modules[-1])
        w = by_first.get(nxt) if nxt is not None else None
        if w is None or len(u.modules) + len(w.modules) > max_group_size:
            continue
        rest = [x for x in units if x is not u and x is not w]
        variants = {(x.reshard_after_forward, x.activation_checkpoint) for x in (u, w)}
        for r, ac in sorted(variants, key=str):
            merged = Unit(u.modules + w.modules, r, ac)
            if ac and any(_nests(merged, c) or _nests(c, merged) for c in checkpointed if c not in (u, w)):
                continue
            move(f"merge {u.name} and {w.name} (reshard {r}, {'AC' if ac else 'no AC'})", rest + [merged], [merged])
    return moves


def _prioritised(moves: list[Move], units: tuple[Unit, ...], touched: frozenset[str], rng: random.Random) -> list[Move]:
    """Global moves, then moves on the units the last move touched and their neighbours in forward
    order, then the rest shuffled (a time-limited pass samples the whole model)."""
    near: set[str] = set(touched)
    for i, u in enumerate(units):
        if touched.intersection(u.modules):
            for v in units[max(0, i - 1): i + 2]:
                near.update(v.modules)
    first = [m for m in moves if m.is_global or not near.isdisjoint(m.touched)]
    rest = [m for m in moves if not (m.is_global or not near.isdisjoint(m.touched))]
    rng.shuffle(rest)
    return first + rest


def in_forward_order(first: dict[str, float], units: list[Unit]) -> tuple[Unit, ...]:
    """The root first, then by the first forward call in each unit's first module's subtree (``first``:
    ``space.first_calls``), an enclosing unit before the units nested in it (the order plans list units in)."""

    def key(u: Unit):
        return (0 if u.is_root else 1, first[u.modules[0]], u.modules[0].count("."))

    return tuple(sorted(units, key=key))


def _nests(outer: Unit, inner: Unit) -> bool:
    """Whether a module of ``inner`` is inside (or is) a module of ``outer``."""
    return any(o == ROOT or i == o or i.startswith(o + ".") for o in outer.modules for i in inner.modules)


def _next_sibling(trace: ModelTrace, fqn: str) -> str | None:
    """The sibling registered right after ``fqn``, or None."""
    parent = trace.module(fqn).parent
    if parent is None:
        return None
    siblings = trace.module(parent).children
    k = siblings.index(fqn)
    return siblings[k + 1] if k + 1 < len(siblings) else None


def _ties_intact(trace: ModelTrace, units: tuple[Unit, ...]) -> bool:
    """Whether every group of modules sharing a Parameter (``tied_with``) lies in one unit: the
    innermost unit holding each module is the same (FSDP2 shards a Parameter in one unit only)."""
    owner = {fqn: k for k, u in enumerate(units) for fqn in u.modules}

    def unit_of(fqn: str) -> int | None:
        while fqn not in owner:
            if fqn == ROOT:
                return None
            fqn = trace.module(fqn).parent
        return owner[fqn]

    return all(unit_of(t) == unit_of(m.fqn) for m in trace.modules for t in m.tied_with)
