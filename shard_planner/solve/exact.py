"""Cross-checks for the CP-SAT program over the same linear model: an exact dynamic program and a
brute force. Both are exponential in places (the DP in the number of distinct memory states) and meant
for small models in tests; CP-SAT is the solver the planner uses.

DP: walk the boundaries ``p = 0..n``; a state is ``(A_p, root MiB used, E_p, P_p, forward slack,
backward slack)`` — what the units so far leave behind, what they added to the root, what the unit
ending at ``p`` re-gathers and leaves as all-gather output for the next one, and how many MiB the next
unit's gathered parameters and reduce-scatter input may take (the previous unit's forward and backward
constraints). Global terms that depend on the whole
cover (``R`` the root's extra memory, ``y`` an int reshard, ``G`` the largest gathered unit) are
fixed by an outer enumeration over their possible values, and each constraint uses the fixed value;
the smallest objective over the enumeration is the optimum of :func:`linear.evaluate`.
"""

from __future__ import annotations

import itertools

from shard_planner.solve.linear import LinearModel, evaluate


def _subset_sums(values: list[int]) -> list[int]:
    sums = {0}
    for v in values:
        sums |= {s + v for s in sums}
    return sorted(sums)


def solve_dp(lm: LinearModel, budget_mib: int) -> tuple[tuple[int, ...], int] | None:
    """The fastest cover with linear peak ≤ budget and its time (µs); None if none fits."""
    cands = lm.space.candidates
    by_start: list[list[int]] = [[] for _ in range(lm.space.n)]
    for k, c in enumerate(cands):
        by_start[c.start].append(k)
    root_values = _subset_sums([co.root_mib for co in lm.coeffs if co.root_mib])  # one per in-root candidate
    needs_g = lm.forward_depth > 1 or lm.backward_depth > 1
    g_values = sorted({co.gather_mib for co in lm.coeffs} | {0}) if needs_g else [0]
    any_int = any(co.uses_int_reshard for co in lm.coeffs)
    best: tuple[int, tuple[int, ...]] | None = None
    for r_val, y, g_val in itertools.product(root_values, (0, 1) if any_int else (0,), g_values):
        found = _dp_fixed(lm, by_start, budget_mib, r_val, y, g_val, needs_g)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    if best is None:
        return None
    return best[1], best[0] + lm.const_time_us


def _dp_fixed(lm, by_start, budget, r_val, y, g_val, needs_g):
    shared = lm.base_mib + r_val + lm.process_group_mib * y
    if lm.optimizer_mib > budget:
        return None
    d_f, d_b = lm.forward_depth, lm.backward_depth
    extra_f = max(0, d_f - 1) * g_val
    extra_b = (d_b - 1) * g_val
    big = budget + 1
    # state: (A_p, root MiB used, regather of the unit ending at p, its prev_out,
    #         slack for the next unit's gather, slack for its rs_in) -> (time, cover)
    frontier_at: dict[int, dict] = {0: {(0, 0, 0, 0, big, big): (0, ())}}
    for p in range(lm.space.n + 1):
        states = frontier_at.pop(p, {})
        if p == lm.space.n:
            best = None
            for (a, _used, _e, _po, _sf, _sb), (t, cover) in states.items():
                if shared + a + lm.loss_mib > budget:
                    continue
                if best is None or t < best[0]:
                    best = (t, cover)
            return best
        for (a, used, e, po, slack_f, slack_b), (t, cover) in states.items():
            for k in by_start[p]:
                co = lm.coeffs[k]
                if used + co.root_mib > r_val or (co.uses_int_reshard and not y):
                    continue
                if needs_g and co.gather_mib > g_val:
                    continue
                if (d_f >= 1 and co.gather_mib > slack_f) or co.rs_in_mib > slack_b:
                    continue  # the previous unit's forward / backward constraint
                level = shared + a
                if level + co.copy_mib + po + extra_f > budget or level + co.rs_mib + e + extra_b > budget:
                    continue
                fwd = level + co.fwd_mib + extra_f
                bwd = level + co.bwd_mib + e + extra_b
                if fwd > budget or bwd > budget:
                    continue
                state = (a + co.stack_mib, used + co.root_mib, co.regather_mib, co.prev_out_mib,
                         budget - fwd if d_f >= 1 else big, budget - bwd)
                nxt = frontier_at.setdefault(lm.space.candidates[k].stop, {})
                cand = (t + co.time_us, cover + (k,))
                if state not in nxt or cand[0] < nxt[state][0]:
                    nxt[state] = cand
    return None


def all_covers(lm: LinearModel):
    """Every exact cover of the items by candidates (as tuples of candidate indices)."""
    by_start: list[list[int]] = [[] for _ in range(lm.space.n)]
    for k, c in enumerate(lm.space.candidates):
        by_start[c.start].append(k)

    def rec(p: int, prefix: tuple[int, ...]):
        if p == lm.space.n:
            yield prefix
            return
        for k in by_start[p]:
            yield from rec(lm.space.candidates[k].stop, prefix + (k,))

    yield from rec(0, ())


def solve_brute_force(lm: LinearModel, budget_mib: int) -> tuple[tuple[int, ...], int] | None:
    """The fastest cover with linear peak ≤ budget, by trying every cover; None if none fits."""
    best = None
    for cover in all_covers(lm):
        res = evaluate(lm, cover)
        if res.peak_mib <= budget_mib and (best is None or res.time_us < best[1]):
            best = (cover, res.time_us)
    return best
