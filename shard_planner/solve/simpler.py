"""Plans as simple as the answer allows: among the plans that fit and are within
``PlanRequest.simpler_within`` (1%) of the fastest predicted step time, the one with the fewest
distinct unit shapes.

Why a post-pass over checked plans, not a tie-break in the CP-SAT objective: the program's time is
the linear model's, a few percent off the simulators' (:mod:`.cpsat`), so a 1% window in its objective
would not be a 1% window in the step time the plan reports; and the fastest plan is often the polish
step's (:mod:`.polish`), which the program never sees. Here every plan is judged by the simulators.

The shape of an inner unit is (the pattern of its modules' names with the digits folded, e.g.
``layers.#`` x 4, its reshard, its checkpointing): a plan of 4-layer units, half of them
checkpointed, has two block shapes. Checkpointing a one-off module (an embedding, a norm, a head:
``Item.may_join_root``) counts as one more, so it stays only when it pays. The candidates: every plan
the planner checked, and uniform variants of the chosen plan (:func:`uniform_variants`: the repeated
blocks in groups of ``g``, one reshard, the first ``k`` groups checkpointed with ``k`` bisected for
the fewest that fit; the one-off units as they were, without checkpointing, or each one-off item a
unit of its own, resharded), each judged by the simulators. These are the plans people write by
hand (torchtitan's per-block units with selective checkpointing), searched; they are often faster than
the program's (the linear model is coarse), and then the answer is simply the faster plan.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from typing import Callable, Sequence, TypeVar

from shard_planner.plan import Unit
from shard_planner.solve.context import Checked, PlanContext
from shard_planner.solve.polish import in_forward_order
from shard_planner.solve.space import SearchSpace, checkpointing_allowed, first_calls

logger = logging.getLogger(__name__)

T = TypeVar("T")


def unit_shape(u: Unit) -> tuple:
    """What two units share when a reader would call them alike."""
    return (tuple(re.sub(r"\d+", "#", m) for m in u.modules), u.reshard_after_forward, u.activation_checkpoint)


def complexity(units: Sequence[Unit], one_off: frozenset[str] = frozenset()) -> int:
    """Distinct shapes of the inner units, plus one per checkpointed unit of one-off modules only."""
    inner = [u for u in units if not u.is_root]
    checkpointed_one_offs = sum(1 for u in inner if u.activation_checkpoint and set(u.modules) <= one_off)
    return len({unit_shape(u) for u in inner}) + checkpointed_one_offs


def simplest_within(options: Sequence[T], step_time_s: Callable[[T], float], units: Callable[[T], Sequence[Unit]],
                    one_off: frozenset[str] = frozenset(), within: float = 0.01) -> T:
    """Among ``options`` (all fitting the budget) within ``within`` of the fastest, the least complex;
    ties go to the faster."""
    fastest_s = min(step_time_s(o) for o in options)
    near = [o for o in options if step_time_s(o) <= fastest_s * (1 + within)]
    return min(near, key=lambda o: (complexity(units(o), one_off), step_time_s(o)))


VARIANT_SEEDS = 3  # plans of the pool, besides the chosen one, whose uniform regroupings are judged


def prefer_simpler(ctx: PlanContext, chosen: Checked, pool: list[Checked],
                   status: str) -> tuple[Checked, str, Checked]:
    """The simplest plan within ``simpler_within`` of the fastest among ``chosen``, ``pool`` and the
    uniform variants of ``chosen``, of the :data:`VARIANT_SEEDS` fastest plans of ``pool`` at its mesh
    and of the fastest of each method there (recipe, cp-sat, ...). A variant may be faster than
    ``chosen``: where the search ends depends on where it started, and a regrouping of a plan it passed
    over can win (ViT-L on 8 GPUs at 5GB: 49.8 ms from the hand-written full checkpointing regrouped,
    83.2 ms from the plan polish ended on). The status says what it costs. Returns (the plan, its
    status, the fastest plan seen)."""
    space = ctx.space(chosen.choice.mesh)
    one_off = frozenset(it.fqn for it in space.items if it.may_join_root)
    same_mesh = sorted((c for c in pool if c.choice.mesh == chosen.choice.mesh and c.units != chosen.units),
                       key=_time_per_sample)
    fastest_by_method = {}
    for c in same_mesh:
        fastest_by_method.setdefault(c.method, c)
    seeds = [chosen, *same_mesh[:VARIANT_SEEDS], *fastest_by_method.values()]
    variants = [v for seed in dict((c.units, c) for c in seeds).values() for v in uniform_variants(ctx, seed, space)]
    options = [c for c in (chosen, *pool, *variants) if c.peak_bytes <= ctx.budget_bytes]
    fastest = min(options, key=lambda c: (_time_per_sample(c), c.peak_bytes, c is not chosen))
    simplest = simplest_within(options, _time_per_sample, lambda c: c.units, one_off, ctx.request.simpler_within)
    if complexity(simplest.units, one_off) >= complexity(fastest.units, one_off):
        simplest = fastest
    if simplest is chosen:
        return chosen, status, fastest
    what = describe_blocks(simplest.units, space)
    if simplest is fastest:
        gain = 100 * (_time_per_sample(simplest) / _time_per_sample(chosen) - 1)
        return simplest, f"{status}; regrouped uniformly ({what}): {gain:+.1f}% step time", fastest
    cost = 100 * (_time_per_sample(simplest) / _time_per_sample(fastest) - 1)
    logger.debug("simpler plan: %d -> %d shapes, %+.2f%% step time", complexity(fastest.units, one_off),
                 complexity(simplest.units, one_off), cost)
    return simplest, (f"{status}; a simpler plan: {what}, {cost:+.1f}% step time against the fastest found "
                      f"({1e3 * fastest.step_time_s:.4g} ms)"), fastest


def _time_per_sample(c: Checked) -> float:
    """What "faster" means across micro-batches (at one micro-batch, the step time's ratios)."""
    return 1.0 / c.samples_per_s if c.samples_per_s > 0 else float("inf")


def block_runs(space: SearchSpace) -> list[list[str]]:
    """The repeated blocks: runs of two or more consecutive sibling items that are not one-offs."""
    runs: list[list[str]] = []
    for prev, it in zip((None, *space.items[:-1]), space.items):
        if it.may_join_root:
            continue
        if runs and prev is not None and not prev.may_join_root and prev.parent == it.parent:
            runs[-1].append(it.fqn)
        else:
            runs.append([it.fqn])
    return [r for r in runs if len(r) >= 2]


def describe_blocks(units: Sequence[Unit], space: SearchSpace) -> str:
    """'4 layers per unit' when the blocks are in groups of one size, else 'N unit shapes'."""
    blocks = {m for run in block_runs(space) for m in run}
    sizes = {len(u.modules) for u in units if not u.is_root and set(u.modules) <= blocks}
    if len(sizes) == 1:
        name = re.sub(r"\.\d+$", "", min(blocks)).rsplit(".", 1)[-1]
        g = sizes.pop()
        return f"{g} {name} per unit" if g > 1 else f"one unit per block of {name}"
    return f"{len({unit_shape(u) for u in units if not u.is_root})} unit shapes"


def uniform_variants(ctx: PlanContext, chosen: Checked, space: SearchSpace) -> list[Checked]:
    """``chosen`` with its repeated blocks regrouped uniformly (see the module docstring), every plan
    judged by the simulators (those over budget too). Nothing when the blocks are not plain units of
    ``chosen`` (a unit nested in a block, or one mixing blocks with other modules)."""
    runs = block_runs(space)
    blocks = {m for run in runs for m in run}
    block_units = [u for u in chosen.units if not u.is_root and set(u.modules) & blocks]
    if not runs or not block_units or any(not set(u.modules) <= blocks for u in block_units) or any(
            any(m.startswith(b + ".") for b in blocks) for u in chosen.units for m in u.modules):
        return []
    reshards = [u.reshard_after_forward for u in block_units]
    r = max(set(reshards), key=lambda v: (reshards.count(v), str(v)))
    # the checkpointing the chosen blocks use most (full or selective) for the first k groups
    modes = [u.activation_checkpoint for u in block_units if u.activation_checkpoint] or [True]
    ac_on = max(set(modes), key=lambda v: (modes.count(v), str(v)))
    largest = max(c.stop - c.start for c in space.candidates)
    one_off = frozenset(it.fqn for it in space.items if it.may_join_root)
    others = [u for u in chosen.units if not set(u.modules) & blocks]
    plain = [replace(u, activation_checkpoint=False) if not u.is_root and set(u.modules) <= one_off else u
             for u in others]
    kept = [u for u in others if u.is_root or not set(u.modules) <= one_off]
    wrapped = {m for u in kept if not u.is_root for m in u.modules}
    own_units = kept + [Unit((it.fqn,), True) for it in space.items
                        if it.may_join_root and not _inside(it.fqn, wrapped)]
    first = first_calls(ctx.trace)
    out: list[Checked] = []
    for g in range(1, largest + 1):
        groups = [tuple(run[i:i + g]) for run in runs for i in range(0, len(run), g)]
        for rest in _distinct(plain, others, own_units):
            def judge(k: int) -> Checked:
                units = in_forward_order(first, rest + [Unit(grp, r, activation_checkpoint=ac_on if j < k else False)
                                                        for j, grp in enumerate(groups)])
                c = ctx.check_units(units, chosen.choice, chosen.status, method=chosen.method)
                out.append(c)
                return c

            _fewest_checkpointed(judge, len(groups) if checkpointing_allowed(ctx.trace) else 0, ctx.budget_bytes)
    return out


def _distinct(*lists: list[Unit]) -> list[list[Unit]]:
    """The lists that differ as sets of units, in order."""
    out: list[list[Unit]] = []
    for units in lists:
        if sorted(map(str, units)) not in [sorted(map(str, o)) for o in out]:
            out.append(units)
    return out


def _inside(fqn: str, wrapped: set[str]) -> bool:
    """Whether ``fqn`` sits inside (or is) a module some kept unit already wraps."""
    return any(fqn == w or fqn.startswith(w + ".") for w in wrapped)


def _fewest_checkpointed(judge: Callable[[int], Checked], groups: int, budget_bytes: int) -> None:
    """Bisect the number ``k`` of checkpointed groups (the first ``k``) for the fewest that fit
    ``budget_bytes``: more checkpointing needs less memory and more time. ``judge(k)`` builds, judges
    and records the plan with ``k`` groups checkpointed."""
    if judge(groups).peak_bytes > budget_bytes:
        return  # not even every group checkpointed fits
    lo, hi = 0, groups
    while lo < hi:
        mid = (lo + hi) // 2
        if judge(mid).peak_bytes <= budget_bytes:
            hi = mid
        else:
            lo = mid + 1
